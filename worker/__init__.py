"""The worker: loads the model once and serves generation requests through the engine."""
