"""One snapshot of a rank's state: what it is, where it goes, when it is copied.

- ``state``       what a rank's state is (tensors and small items: RNG, the data position of ``baft.position``)
- ``resumed_iteration`` what a restore sets as the first resumed iteration starts (the generators, the script's
                  schedulers and globals, the weights its loop's code changed again)
- ``optimizers``  where each DeepSpeed optimizer wrapper keeps its masters and moments
- ``sizes``       how big the snapshot is and how fast it copies (for the profiler)
- ``layout``      the state's byte layout in a host buffer, chunked, and its commit record
- ``checksum``    chunk checksums a GPU computes from the source and the host verifies from the slot
- ``slots``       the shared-memory slots a snapshot is copied into, commit record last
- ``copy``        copying one snapshot into a slot, chunk by chunk; sealing it off the trainer's path
- ``copiers``     how the chunks leave the live tensors before the fence: the host copies them, or a stream
- ``streams``     copy streams: a CUDA side stream fenced by events, or a thread on CPU
- ``planner``     which chunk is copied in which bubble (from a bubble map)
- ``policies``    when copies run: baft's bubble executor, synchronous copy, thread copy
- ``metrics``     what a policy did, as data (benchmark, ``baft compare``), and when it snapshots
- ``build``       the policy a config asks for, and the planned executor it builds
- ``baselines``   the disk checkpoints baft is compared with (DeepSpeed, torch.save, DCP)
- ``trace``       a run's per-instruction trace with the executor's copies in it, and reading it back

May import ``pipeline``; never ``manager``, ``recovery`` or anything above.
"""
