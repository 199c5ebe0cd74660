"""The load path: from a committed step on storage back into a state dict.

restore.py      loading one verified step, whole or into a template (resharded); a format-2
                step reads only the rank index objects of the tensors it fills.
recover.py      collective restore: the same verified step on every rank, with fallback
                to an older step when the newest fails verification; counts the bytes read
                for the caller's `on_progress`.
quarantine.py   the corrupt steps a restore skipped, moved aside by the coordinator (under
                the lease, in short collective rounds) so the run saves their numbers again.
regions.py      one committed step opened for box reads (skeleton, tensor dtypes/shapes,
                fill a box; files verified on first touch): what `dcp.py` reads through.
reshard.py      assemble any box / flat-range region of a tensor from stored pieces.
"""
