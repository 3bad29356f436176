"""A restart: agree on the newest step every rank holds, restore it, and account for the time.

- ``agree``    which step: the newest every pipeline stage can reach, computed alike on every rank
- ``restore``  loading that step into the engine, all ranks or none; refusing a silent fresh start
- ``restored_weights`` the weights as restored, kept as checksums: those the resumed script changes before its
  first iteration are set back from the snapshot's slot
- ``adopt``    a job's first start under baft, from its DeepSpeed checkpoint
- ``record``   the T0..T4 of every restart, written after the first resumed iteration and read back
- ``chaos``    fault injection (kill, hang, corrupt) for tests and experiments
- ``chaos_hook`` the hook that carries out those faults inside a rank's iterations
- ``inspect``  describe and verify a snapshot in shared memory or on disk
- ``digests``  per-step, per-part digests of a rank's state: proof that a resumed run is bit-identical
- ``script_checkpoint`` the script's ``client_state`` in every snapshot; its ``load_checkpoint`` kept from
  undoing a restore
- ``in_place`` recovery in place: a survivor keeps its process, and its failed ``train_batch`` goes on
- ``world``    the process groups of a job that recovers in place: survivors and replacement meet in a new world

May import ``pipeline``, ``snapshot`` and ``manager``; never ``cli``.
"""
