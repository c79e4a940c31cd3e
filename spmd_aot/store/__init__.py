"""Where built artifacts live: a content-addressed, torch-free blob store with named refs."""

from .local import BlobProblem, LocalStore, resolve_cache_dir

__all__ = ["LocalStore", "resolve_cache_dir", "BlobProblem"]
