"""Stream mode's spool and progress, without a server: what a resumed
spool keeps of what the capture stored, how the capture's parts grow with
the room the trainer leaves, and the recent rates the run's progress shows."""
import torch

from tasks.capture.config import CaptureConfig
from tasks.data.dataset import prepare_samples
from tasks.store.handle import Store
from tasks.stream.parts import cut_parts, part_samples
from tasks.stream.plan import StreamPlan, plan_stream
from tasks.stream.progress import describe_progress
from tasks.stream.spool import epoch_store, read_position, spooled_bytes
from tasks.stream.state import mark_capture, mark_trainer, record_progress
from tasks.target.architectures import load_tokenizer
from tests.conftest import demo_rows, write_jsonl
from tests.test_stream import ROWS, config


def test_a_resumed_spool_keeps_what_the_trainer_reads_first_and_room_for_what_it_waits_for(tiny_model, tmp_path):
    """Seen (the UI-cancel test, once): a stream run stopped just after a
    step past its checkpoint, the capture ahead in the next epoch, the spool
    full. Started again, the trainer waited for the batch it had trained
    after the checkpoint (its shards removed), the capture for room that
    later parts held, until the deadlock check stopped both. Here the
    capture nodes' variant of it: one part still in flight (missing) with
    later ones stored. Before either side starts, the spool keeps what the
    trainer reads in order from the checkpoint up to the first sample
    missing, and nothing after it; the part the trainer waits for fits."""
    from tasks.store.ledger.open import open_store
    from tasks.store.manifest import build_manifest
    from tasks.store.shards import write_shard
    from tasks.target.architectures import architecture_at
    from tasks.target.layers import AuxLayers
    from tasks.train.layers.sizes import target_sizes
    from tasks.stream.parts import trim_spool
    from tasks.stream.spool import write_position

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))
    capture = CaptureConfig(dataset=str(dataset), batch_size=4, max_length=256)
    plan = plan_stream(str(tiny_model), capture, config(tmp_path / "train", spool_bytes=10**9))
    tokenizer = load_tokenizer(tiny_model)
    samples = {s.source_row: s for s in prepare_samples(dataset, tokenizer, max_length=256)[0]}
    layers, hidden = AuxLayers.for_model(8), target_sizes(tiny_model)["hidden_size"]
    manifest = build_manifest(tiny_model, tokenizer, layers, architecture_at(tiny_model), max_length=256,
                              policy="truncate", sources=[str(dataset)])
    root, g = tmp_path / "store", torch.Generator().manual_seed(0)
    epoch_store(root, 0).parent.mkdir(parents=True)
    write_position(root, 0, 2)  # checkpointed after two batches of epoch 0
    order = [(e, r) for e in (0, 1) for b in plan.epochs[e][2 if e == 0 else 0:] for r in b]
    chunks = [order[k:k + 4] for k in range(0, len(order), 4)]  # the capture's batches, each a shard
    shards = {}
    # Up to the first batch that reaches into epoch 1 (how many, the samples' lengths say).
    reach = next(k for k, chunk in enumerate(chunks) if any(e == 1 for e, _ in chunk))
    for k, chunk in enumerate(chunks[:reach + 1]):
        if k == 1:
            continue  # in flight when the run stopped
        for epoch in sorted({e for e, _ in chunk}):  # a batch across the epochs' border: a shard in each
            home = epoch_store(root, epoch)
            items = [{"sample_id": samples[r].sample_id, "source_row": r, "input_ids": samples[r].input_ids,
                      "loss_mask": samples[r].loss_mask,
                      "aux_hidden_states": torch.randn(samples[r].num_tokens, 3, hidden, generator=g),
                      "final_hidden_state": torch.randn(samples[r].num_tokens, hidden, generator=g)}
                     for e, r in chunk if e == epoch]
            ledger = open_store(home, manifest)
            info, rows = write_shard(home, items, source=str(dataset))
            ledger.commit_shard(info, rows)
            shards[k, epoch] = info.name
    assert {e for _, e in shards} == {0, 1}  # the stored parts reach into the next epoch
    full = spooled_bytes(root)
    room = full  # the spool was full
    first = next(p for p in cut_parts(plan, 4, room, read_position(root)) if p.need)
    assert full + first.need > room  # as it was, the capture could never store what the trainer waits for

    removed = trim_spool(root, plan)
    kept = {e: set(Store.open(epoch_store(root, e)).ledger.shards().name) for e in (0, 1)}
    assert kept == {0: {shards[0, 0]}, 1: set()}  # up to the part in flight, nothing after it
    assert {f.stem for f in epoch_store(root, 0).glob("shards/*.safetensors")} == {shards[0, 0]}
    assert removed == full - spooled_bytes(root) > 0
    assert spooled_bytes(root) + first.need <= room
    assert trim_spool(root, plan) == 0  # what is left is what the trainer reads first


def test_the_progress_shows_recent_rates_not_means_since_the_start(tmp_path):
    """A capture that resumed past stored parts in its first 100 s (100k
    tokens), then crawls (1k tokens in 60 s), and a trainer that slowed
    likewise: the artifact's rates and ETA are the last minute's."""
    mark_capture(tmp_path, "running")
    mark_trainer(tmp_path, "running")
    for at, tokens in ((0, 0), (100, 100_000), (130, 100_500), (160, 101_000)):
        record_progress(tmp_path, "captured", now=at, epoch=0, epochs=1, samples=0, of=10, tokens=tokens, started=0,
                        paused_s=0)
    for at, steps in ((0, 0), (100, 100), (160, 106)):  # 6 steps in the last 60 s: 0.1 a second
        record_progress(tmp_path, "trained", now=at, epoch=0, epochs=1, step=steps, total_steps=166, steps=steps,
                        tokens=steps * 100, started=0)
    _, text = describe_progress(tmp_path, None)
    assert text == ("capture running: epoch 1/1, 0 of 10 samples, 101,000 tokens at 17 tok/s; trainer running: "
                    "epoch 1/1, step 106 of 166, 10,600 tokens at 10 tok/s, ETA 10 min 00 s")


def test_spooled_parts_grow_with_the_room_the_trainer_leaves():
    """Parts are two capture batches while the spool is near its minimum
    (as in the tests above) and grow, in whole batches, to a quarter of what
    the trainer's minimum leaves (a Kimi-size spool pays an extraction run
    per part); either way every row once, in training order."""
    rows = list(range(4000))
    plan = StreamPlan(heldout=[9000, 9001], rejected=[9002], epochs=[[rows[k:k + 4] for k in range(0, 4000, 4)]] * 2,
                      tokens={r: 2000 for r in rows + [9000, 9001]}, bytes_per_token=57_344, minimum=40 * 2**30)
    sample, two = plan.shard_bytes(rows, 8) / len(rows), plan.shard_bytes(rows[:16], 8)  # two batches: in the minimum
    for room, size in ((plan.minimum, 16), (plan.minimum + 100 * 2**30, 8 * int(100 * 2**30 / 4 / sample / 8))):
        parts = cut_parts(plan, 8, room)
        assert part_samples(plan, 8, room) == size and size % 8 == 0
        assert parts[0].rows == (9000, 9001, 9002) and parts[0].into == ""
        for e in (0, 1):
            mine = [p for p in parts if p.epoch == e]
            assert [r for p in mine for r in p.rows] == rows and {len(p.rows) for p in mine[:-1]} == {size}
            assert {p.into for p in mine} == {f"spool/epoch-000{e}"} and all(p.need <= max(two, (room - plan.minimum) / 4) for p in mine)
    assert size > 16
    resumed = cut_parts(plan, 8, plan.minimum, position=(1, 10))  # epoch 2, 10 batches (40 rows) trained
    assert [r for p in resumed[1:] for r in p.rows] == rows[40:] and {p.epoch for p in resumed[1:]} == {1}
