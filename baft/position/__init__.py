"""The data position: which batch a resumed run reads next, kept with every snapshot and put back by a restore.

- ``kept``        which position baft keeps of what the script reads, and what it says where one cannot bring the
                  data back as it was
- ``resumable``   a resumable loader's (torchdata's ``StatefulDataLoader``), and what baft keeps beside its state
- ``engine_loader`` the engine's own loader (``training_data=``) and its workers' seeds
- ``repeated_loader`` a plain ``DataLoader`` the loop repeats through ``RepeatingLoader``
- ``deepspeed_loader`` DeepSpeed's own loader that the script makes (``engine.deepspeed_io``), seen as a plain one
- ``plain_loader`` a plain ``DataLoader`` whose iterators the loop takes itself
- ``epoch_position`` what those two share: the sampler's, the generator's and the dataset's part of an epoch
- ``found_position`` the position where ``baft.initialize`` was given none, found as the loop first reads
- ``wrappers``    a wrapper of the script's around the iterator ``train_batch`` reads (a cast), read through
- ``epoch_starts`` DeepSpeed's ``RepeatingLoader``, noting what each epoch's iterator was made from
- ``stream_carried`` the lists a stream read in this process carries from one pass to the next (a remainder)
- ``stream_files`` where the files a stream read in this process holds open stand as each pass begins
- ``first_iterators`` what the iterators the script makes between ``baft.initialize`` and its loop's first call were
                  made from
- ``samplers``    a sampler's own state as it draws each epoch's order
- ``settings``    the plain settings a loop changes in its dataset or ``collate_fn``
- ``caches``      the dicts a dataset fills as it first reads each sample (a cache), kept where small
- ``dataset_source`` a data class's source: an attribute it sets itself as it reads, a draw from a global generator
- ``iterators``   a loader's iterator as the loop holds it: its epoch's mark, a restored one's state moved into it
- ``reads``       what ``train_batch`` reads, call by call, against the loader whose position is kept

May import ``script``, ``pipeline`` and ``snapshot``; never ``manager``, ``recovery`` or anything above.
"""
