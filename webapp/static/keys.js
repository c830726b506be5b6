/* The API keys page: ask before revoking, and copy a new key to the clipboard. */
(() => {
  "use strict";

  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }

  const copy = document.getElementById("copy-key");
  const value = document.getElementById("new-key-value");
  if (copy && value && navigator.clipboard) {
    copy.hidden = false;
    copy.addEventListener("click", async () => {
      await navigator.clipboard.writeText(value.textContent);
      copy.textContent = "Copied";
    });
  }
})();
