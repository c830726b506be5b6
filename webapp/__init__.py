"""Flask web app: the customer chat page, the OpenAI-compatible API and the operators' dashboard."""
