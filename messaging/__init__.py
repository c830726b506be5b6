"""What the web app and the worker share: the queue contract (names, keys, channels) and how to connect to Redis."""
