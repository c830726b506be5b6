/*
 * Customer chat page: sends messages and streams the assistant's answers over Socket.IO.
 *
 * Needs the global `io` from static/vendor/socket.io.min.js, the Socket.IO browser client
 * v4.8.4 (npm socket.io-client@4.8.4, MIT), which speaks Engine.IO protocol 4 as
 * Flask-SocketIO 5.x expects.
 *
 * Events (default namespace):
 *   emit   chat_message {conversation_id?, text}      emit cancel {request_id}
 *   on     accepted {request_id, conversation_id}
 *          token    {request_id, text, offset}        a text delta, `offset` characters into the answer
 *          done     {request_id, conversation_id, text, finish_reason, prompt_tokens, completion_tokens}
 *          error    {request_id?, code, message, retryable}
 *
 * Model and user text only ever reaches the page through text nodes, never as HTML.
 *
 * A lost connection does not lose an answer: the worker keeps writing it and stores it. After a
 * reconnect (to the same web process or another) the page rejoins the conversation's room and reads
 * GET /conversations/<id> to fill in an answer that finished while it was away; it reads it again
 * whenever an answer goes quiet, in case its end was lost on the way (e.g. while Redis restarted).
 */
(function () {
  'use strict';

  // Shown under an answer that ended for a reason other than a natural stop.
  var FINISH_NOTES = {
    length: '(cut short)',
    cancelled: '(stopped)',
    error: '(interrupted)'
  };

  // If the server never confirms a Stop, give the controls back after this long.
  var CANCEL_GRACE_MS = 8000;

  // An answer that sends nothing for this long is looked up in the stored conversation; the pause
  // doubles after each look that finds it still under way, up to the maximum.
  var QUIET_CHECK_MS = 5000;
  var QUIET_CHECK_MAX_MS = 30000;

  // Follow the stream only while the reader is already near the bottom of the thread.
  var STICKY_SCROLL_PX = 96;

  var STATUS_LABELS = {
    connecting: 'Connecting…',
    connected: 'Connected',
    reconnecting: 'Reconnecting…',
    offline: 'Offline'
  };

  var els = {
    root: document.getElementById('chat'),
    thread: document.getElementById('thread'),
    intro: document.getElementById('intro'),
    messages: document.getElementById('messages'),
    form: document.getElementById('composer'),
    input: document.getElementById('input'),
    send: document.getElementById('send'),
    stop: document.getElementById('stop'),
    newChat: document.getElementById('new-chat'),
    status: document.getElementById('status')
  };

  var state = {
    conversationId: els.root.getAttribute('data-conversation-id') || null,
    connected: false,
    // Set after the first connect, so the next one is known to be a reconnect.
    wasConnected: false,
    // The request being answered: {text, requestId, el, textNode, received, base, gap, heardAt,
    // quietMs, cancelRequested, cancelTimer}.
    current: null,
    // A look at the stored conversation is under way.
    syncing: false,
    // Requests already finished or given up here; their late events must not open a new answer.
    settled: new Set()
  };

  /* ---------- DOM helpers ---------- */

  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text) node.textContent = text;
    return node;
  }

  // Same markup as the server renders for history, so both look and behave alike.
  function createMessage(role, text) {
    var item = el('li', 'msg msg--' + role);
    item.setAttribute('data-role', role);
    var bubble = el('div', 'msg__bubble');
    var body = el('div', 'msg__text');
    body.appendChild(document.createTextNode(text || ''));
    bubble.appendChild(body);
    item.appendChild(bubble);
    return item;
  }

  function textOf(item) {
    return item.querySelector('.msg__text');
  }

  function typingIndicator() {
    var dots = el('span', 'typing');
    dots.setAttribute('aria-hidden', 'true');
    dots.append(el('span'), el('span'), el('span'));
    return dots;
  }

  function addToThread(node) {
    var follow = isNearBottom();
    els.messages.appendChild(node);
    els.intro.hidden = true;
    if (follow) scrollToBottom();
  }

  function isNearBottom() {
    var t = els.thread;
    return t.scrollHeight - t.scrollTop - t.clientHeight < STICKY_SCROLL_PX;
  }

  function scrollToBottom() {
    els.thread.scrollTop = els.thread.scrollHeight;
  }

  // When the thread changes size (a phone keyboard opening, a rotated screen), keep the
  // latest message in view if the reader was following it.
  function keepBottomOnResize() {
    var following = true;
    els.thread.addEventListener('scroll', function () {
      following = isNearBottom();
    }, { passive: true });
    if (!('ResizeObserver' in window)) return;
    new ResizeObserver(function () {
      if (following) scrollToBottom();
    }).observe(els.thread);
  }

  /* ---------- State shown in the page ---------- */

  function setStatus(name) {
    els.status.setAttribute('data-state', name);
    els.status.querySelector('.status__label').textContent = STATUS_LABELS[name];
  }

  function updateControls() {
    var streaming = state.current !== null;
    els.send.disabled = streaming || !state.connected;
    els.stop.disabled = !streaming || state.current.cancelRequested;
    els.newChat.disabled = streaming;
    els.messages.querySelectorAll('[data-action="retry"]').forEach(function (button) {
      button.disabled = streaming || !state.connected;
    });
  }

  // Keep ?c=<id> in the address bar so a reload reopens the same conversation.
  function setConversationId(id) {
    state.conversationId = id || null;
    var url = new URL(window.location.href);
    if (state.conversationId) url.searchParams.set('c', state.conversationId);
    else url.searchParams.delete('c');
    if (url.href !== window.location.href) {
      window.history.replaceState(window.history.state, '', url.href);
    }
  }

  // Moving focus back to the textarea is only helpful when it would otherwise be lost,
  // e.g. on a button that has just been disabled.
  function restoreFocus() {
    var active = document.activeElement;
    if (!active || active === document.body || active.disabled) els.input.focus();
  }

  /* ---------- Sending ---------- */

  // Adds the assistant's bubble (dots until the first token) and makes it the answer in progress.
  // `text` is what was asked from this page, kept for Retry; null for an answer we only follow.
  function startAnswer(text) {
    var answer = createMessage('assistant', '');
    answer.setAttribute('data-streaming', 'true');
    answer.setAttribute('aria-busy', 'true');
    answer.querySelector('.msg__bubble').appendChild(typingIndicator());
    addToThread(answer);

    state.current = {
      text: text,
      requestId: null,
      el: answer,
      textNode: textOf(answer).firstChild,
      // Characters (code points, as the server counts them) of the answer shown, from `base` on.
      received: 0,
      base: null,
      // Some text never arrived: the rest waits for the final text.
      gap: false,
      heardAt: Date.now(),
      quietMs: QUIET_CHECK_MS,
      cancelRequested: false,
      cancelTimer: null
    };
    return state.current;
  }

  function sendMessage(text, options) {
    if (state.current || !state.connected) return false;
    clearRetryOffers();
    if (!options || options.echo !== false) addToThread(createMessage('user', text));
    startAnswer(text);
    scrollToBottom();

    var payload = { text: text };
    if (state.conversationId) payload.conversation_id = state.conversationId;
    socket.emit('chat_message', payload);
    updateControls();
    return true;
  }

  function submitInput() {
    var text = els.input.value.trim();
    if (!text) {
      els.input.focus();
      return;
    }
    if (sendMessage(text)) {
      els.input.value = '';
      autoGrow();
    }
    els.input.focus();
  }

  function requestStop() {
    var current = state.current;
    if (!current || current.cancelRequested) return;
    current.cancelRequested = true;
    // Before `accepted` there is no id to cancel yet; handleAccepted sends it then.
    if (current.requestId) socket.emit('cancel', { request_id: current.requestId });
    current.cancelTimer = window.setTimeout(function () {
      if (state.current === current) finishAnswer('cancelled');
    }, CANCEL_GRACE_MS);
    updateControls();
    els.input.focus();
  }

  /* ---------- Receiving ---------- */

  // Tokens and results go to the conversation's room, so the page can also hear answers it
  // did not ask for here: one still being written when the page was reloaded, or one asked
  // in another tab. The answer this page is streaming matches by request_id only.
  function answerFor(payload) {
    var id = payload && payload.request_id;
    var current = state.current;
    if (current) return current.requestId !== null && current.requestId === id ? current : null;
    if (!id || state.settled.has(id)) return null;
    return followAnswer(id);
  }

  // Shows an answer that this page did not start (no text of ours to retry with).
  function followAnswer(requestId) {
    var current = startAnswer(null);
    current.requestId = requestId;
    current.el.setAttribute('data-request-id', requestId);
    updateControls();
    return current;
  }

  function handleAccepted(payload) {
    var current = state.current;
    // `accepted` goes only to the sender, so it names the request this page just sent.
    if (!current || current.requestId !== null || !payload) return;
    heard(current);
    current.requestId = payload.request_id;
    current.el.setAttribute('data-request-id', payload.request_id);
    if (payload.conversation_id) setConversationId(payload.conversation_id);
    if (current.cancelRequested) socket.emit('cancel', { request_id: current.requestId });
  }

  function codePoints(text) {
    return Array.from(text);
  }

  // Only text that continues exactly where the shown text ends is added: a repeat (a resumed
  // stream) is trimmed, and after a gap the final text fills in the rest.
  function handleToken(payload) {
    if (!payload || !payload.text) return;
    var current = answerFor(payload);
    if (!current) return;
    heard(current);
    var offset = typeof payload.offset === 'number' ? payload.offset : null;
    // An answer followed from the middle (e.g. after a reload) is shown from where it was joined.
    if (current.base === null) current.base = offset === null ? 0 : offset;
    var at = current.base + current.received;
    if (offset === null) offset = at;
    if (current.gap || offset > at) {
      current.gap = true;
      return;
    }
    var text = codePoints(payload.text).slice(at - offset);
    if (!text.length) return;
    var follow = isNearBottom();
    removeTypingIndicator(current.el);
    current.textNode.appendData(text.join(''));
    current.received += text.length;
    if (follow) scrollToBottom();
  }

  function heard(current) {
    current.heardAt = Date.now();
    current.quietMs = QUIET_CHECK_MS;
  }

  function handleDone(payload) {
    var current = answerFor(payload);
    if (!current) return;
    // The final text is authoritative: it covers any delta lost on the way.
    if (typeof payload.text === 'string') {
      removeTypingIndicator(current.el);
      current.textNode.data = payload.text;
    }
    if (payload.conversation_id) setConversationId(payload.conversation_id);
    if (payload.prompt_tokens != null) current.el.setAttribute('data-prompt-tokens', payload.prompt_tokens);
    if (payload.completion_tokens != null) {
      current.el.setAttribute('data-completion-tokens', payload.completion_tokens);
    }
    finishAnswer(payload.finish_reason || 'stop');
  }

  // Whether an error ends the answer in progress: an error about that request, or a rejection
  // of the message just sent, which can come before `accepted` has named it.
  function endsCurrent(payload) {
    var current = state.current;
    if (!current) return false;
    return current.requestId === null || payload.request_id === current.requestId;
  }

  function handleError(payload) {
    payload = payload || {};
    var message = payload.message || 'Something went wrong.';
    if (!endsCurrent(payload)) {
      // One with a request_id belongs to another answer (another tab, or one already closed here).
      // One without is about this page (e.g. the conversation could not be rejoined): say so.
      if (!payload.request_id) addToThread(createNotice(message, null));
      return;
    }
    var current = state.current;
    // A Stop that reached the queue before the answer started ends as an error; to the reader it is a stop.
    if (payload.code === 'cancelled' && current.cancelRequested) {
      finishAnswer('cancelled');
      return;
    }
    finishAnswer('error');
    addToThread(createNotice(message, payload.retryable ? current.text : null));
  }

  // Ends the answer in progress: marks it finished, notes why if unusual, frees the controls.
  function finishAnswer(reason) {
    var current = state.current;
    if (!current) return;
    window.clearTimeout(current.cancelTimer);
    if (current.requestId) state.settled.add(current.requestId);
    state.current = null;

    var item = current.el;
    removeTypingIndicator(item);
    item.removeAttribute('data-streaming');
    item.setAttribute('data-finish-reason', reason);
    var hasText = current.textNode.data.length > 0;

    if (reason === 'error' && !hasText) {
      // Nothing was said; the error notice that follows speaks for this answer.
      item.remove();
    } else {
      var note = FINISH_NOTES[reason] || (reason !== 'stop' ? '(' + reason + ')' : '');
      if (!note && !hasText) note = '(no answer)';
      if (note) item.querySelector('.msg__bubble').appendChild(el('span', 'msg__note', note));
      item.setAttribute('aria-busy', 'false');
    }
    updateControls();
    restoreFocus();
  }

  function removeTypingIndicator(item) {
    var dots = item.querySelector('.typing');
    if (dots) dots.remove();
  }

  /* ---------- Error notices and retry ---------- */

  function createNotice(message, retryText) {
    var notice = el('li', 'notice');
    notice.setAttribute('data-role', 'error');
    notice.setAttribute('role', 'alert');
    notice.appendChild(alertIcon());
    notice.appendChild(el('p', 'notice__text', message));
    if (retryText) {
      var retry = el('button', 'btn btn--secondary btn--small', 'Retry');
      retry.type = 'button';
      retry.setAttribute('data-action', 'retry');
      retry.disabled = state.current !== null || !state.connected;
      retry.addEventListener('click', function () {
        if (sendMessage(retryText, { echo: false })) notice.remove();
        els.input.focus();
      });
      notice.appendChild(retry);
    }
    return notice;
  }

  function alertIcon() {
    var ns = 'http://www.w3.org/2000/svg';
    var svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('class', 'notice__icon');
    svg.setAttribute('viewBox', '0 0 24 24');
    svg.setAttribute('aria-hidden', 'true');
    svg.setAttribute('focusable', 'false');
    var path = document.createElementNS(ns, 'path');
    path.setAttribute('d', 'M12 2a10 10 0 1 0 0 20 10 10 0 0 0 0-20zm1 15h-2v-2h2v2zm0-4h-2V7h2v6z');
    svg.appendChild(path);
    return svg;
  }

  // A newer request makes older retry offers stale; resending them would reorder the thread.
  function clearRetryOffers() {
    els.messages.querySelectorAll('[data-action="retry"]').forEach(function (button) {
      button.remove();
    });
  }

  /* ---------- Catching up with the stored conversation ---------- */

  // Reads the stored conversation and settles the answer in progress from it, if it can.
  function resync() {
    var current = state.current;
    if (!current || !state.conversationId || state.syncing) return;
    state.syncing = true;
    fetch('/conversations/' + encodeURIComponent(state.conversationId), {
      credentials: 'same-origin',
      cache: 'no-store',
      headers: { Accept: 'application/json' }
    }).then(function (response) {
      return response.ok ? response.json() : null;
    }).then(function (data) {
      if (data && state.current === current) reconcile(current, data);
    }).catch(function () {
      // Offline or the server is restarting: the next reconnect or quiet check tries again.
    }).then(function () {
      state.syncing = false;
    });
  }

  function reconcile(current, data) {
    var messages = Array.isArray(data.messages) ? data.messages : [];
    var unfinished = Array.isArray(data.unfinished) ? data.unfinished : [];
    if (current.requestId === null && !adoptUnconfirmed(current, messages, unfinished)) return;
    var stored = messages.filter(function (m) { return m.request_id === current.requestId; })[0];
    if (stored) {
      removeTypingIndicator(current.el);
      current.textNode.data = stored.content;
      finishAnswer('stop');
    } else if (unfinished.indexOf(current.requestId) < 0) {
      // It ended without an answer (stopped, or failed) while this page was not listening.
      interrupt('The answer was interrupted; please send your message again.');
    }
    // Otherwise it is still queued or being written: its events reach the rejoined room.
  }

  // A message sent just before the connection dropped, never confirmed by `accepted`: the stored
  // conversation tells whether the server took it, and which request answers it.
  function adoptUnconfirmed(current, messages, unfinished) {
    var users = messages.filter(function (m) { return m.role === 'user'; }).length;
    var shown = els.messages.querySelectorAll('[data-role="user"]').length;
    if (users < shown) {
      interrupt('Your message did not reach us; please send it again.');
      return false;
    }
    var last = messages[messages.length - 1];
    var id = last && last.role === 'assistant' ? last.request_id : unfinished[unfinished.length - 1];
    if (!id) {
      interrupt('The answer was interrupted; please send your message again.');
      return false;
    }
    current.requestId = id;
    current.el.setAttribute('data-request-id', id);
    return true;
  }

  function interrupt(message) {
    var text = state.current && state.current.text;
    finishAnswer('error');
    addToThread(createNotice(message, text));
  }

  // While an answer is under way and quiet, look it up now and then (with a growing pause).
  function checkQuietAnswer() {
    var current = state.current;
    if (!current || current.requestId === null || !state.connected) return;
    if (Date.now() - current.heardAt < current.quietMs) return;
    current.heardAt = Date.now();
    current.quietMs = Math.min(QUIET_CHECK_MAX_MS, current.quietMs * 2);
    resync();
  }

  /* ---------- Connection ---------- */

  function handleConnect() {
    state.connected = true;
    setStatus('connected');
    // Rooms do not survive a reconnect: rejoin so this conversation's answers reach the page.
    if (state.conversationId) socket.emit('join', { conversation_id: state.conversationId });
    // What happened while away: an answer may have finished, or still be on its way.
    if (state.wasConnected && state.current) resync();
    state.wasConnected = true;
    updateControls();
  }

  function handleDisconnect(reason) {
    state.connected = false;
    setStatus('reconnecting');
    // An answer in progress is kept: after the reconnect it is caught up from the stored conversation.
    // The client only reconnects by itself when the server did not close the socket on purpose.
    if (reason === 'io server disconnect') socket.connect();
    updateControls();
  }

  /* ---------- Composer ---------- */

  // Grow the textarea with its content up to the CSS max-height, then scroll inside it.
  function autoGrow() {
    els.input.style.height = 'auto';
    els.input.style.height = els.input.scrollHeight + 2 + 'px';
  }

  function handleKeydown(event) {
    // isComposing: Enter that confirms an IME candidate must not send.
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!els.send.disabled) submitInput();
    } else if (event.key === 'Escape' && state.current) {
      event.preventDefault();
      requestStop();
    }
  }

  // A fresh page, not just a cleared thread: the socket leaves the old conversation's room too.
  function startNewChat() {
    if (state.current) return;
    window.location.assign(window.location.pathname);
  }

  /* ---------- Start ---------- */

  if (typeof window.io !== 'function') {
    setStatus('offline');
    addToThread(createNotice('The chat could not load. Please refresh the page.', null));
    return;
  }

  var socket = window.io();
  socket.on('connect', handleConnect);
  socket.on('disconnect', handleDisconnect);
  socket.on('connect_error', function () {
    state.connected = false;
    setStatus('reconnecting');
    updateControls();
  });
  socket.on('accepted', handleAccepted);
  socket.on('token', handleToken);
  socket.on('done', handleDone);
  socket.on('error', handleError);

  els.form.addEventListener('submit', function (event) {
    event.preventDefault();
    submitInput();
  });
  els.stop.addEventListener('click', requestStop);
  els.newChat.addEventListener('click', startNewChat);
  els.input.addEventListener('keydown', handleKeydown);
  els.input.addEventListener('input', autoGrow);

  setConversationId(state.conversationId);
  setStatus(socket.connected ? 'connected' : 'connecting');
  state.connected = socket.connected;
  updateControls();
  scrollToBottom();
  keepBottomOnResize();
  window.setInterval(checkQuietAnswer, 1000);
})();
