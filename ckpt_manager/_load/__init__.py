"""The load path: from a committed step on storage back into a state dict.

restore.py      loading one verified step, whole or into a template (resharded); a format-2
                step reads only the rank index objects of the tensors it fills.
recover.py      collective restore: the same verified step on every rank, with fallback
                to an older step when the newest fails verification; counts the bytes read
                for the caller's `on_progress`.
reshard.py      assemble any box / flat-range region of a tensor from stored pieces.
"""
