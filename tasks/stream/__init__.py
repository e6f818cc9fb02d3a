"""Stream mode: training while the capture runs (`train.stream`).

The samples a run will train on, and each epoch's batches, are known before
any is captured (the dataset's tokenisation gives every sample id and token
count), so the trainer plans exactly what an offline run over the finished
store would, and reads each sample as soon as its shard is committed.

    plan.py      what is captured, in the order training reads it (StreamPlan)
    parts.py     the plan cut into capture parts, and their lease queue for
                 capture nodes (in the store's PostgreSQL index)
    spool.py     with train.spool_bytes, each epoch's spool store, the bytes it
                 holds, the resume's trim, and the back-pressure both capture
                 paths ask (SpoolBudget)
    state.py     each side's state for the other (running, stopped, waiting),
                 and its progress
    reader.py    the trainer's side: a reader that waits for each sample, and
                 frees each spooled shard once trained on every rank
    progress.py  both sides in one line, for the run's progress artifact

The flows (flows/stream.py, flows/stream_node.py) only wire these together.
"""
