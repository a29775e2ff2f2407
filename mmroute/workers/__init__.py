"""Worker registry: backend detection, KV source discovery, health and reported load."""

from mmroute.workers.registry import KVSource, Worker, WorkerRegistry

__all__ = ["KVSource", "Worker", "WorkerRegistry"]
