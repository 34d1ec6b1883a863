"""The Celery fleet: the app and its task, what a worker does with a delivered shard, the
broker's view, fair share between tenants, the live-worker registry and the reconciler."""
