"""Flow parameters that more than one flow takes, declared once: type,
limits and description (the CLI's help and the Prefect UI's run form read
them) and default. A flow's signature uses these, so `extract` and
`pipeline`, or `train` and `pipeline`, cannot drift apart."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from tasks.capture.dump import RID_PREFIX
from tasks.data.dataset import DEMO_DATASET
from tasks.target.models import SMOLLM2
from tasks.train.loop import TrainConfig

DEFAULT_DATASET = str(DEMO_DATASET)
DEFAULT_MODEL = SMOLLM2
# TrainConfig's own defaults: the plain function and the flows agree.
TRAIN = TrainConfig(store="", out_dir="")

# Extraction.
Dataset = Annotated[str, Field(description="JSONL/JSON/Parquet: messages, conversations, text or input_ids rows "
                                           "(best: answered by the target itself)")]
Model = Annotated[str, Field(description="target model: a checkpoint folder, or 'smollm2-135m-instruct' / "
                                         "'tiny-llama'")]
ServerUrl = Annotated[Optional[str], Field(description="attach to this running capture server instead of "
                                                       "launching one")]
ServerApiKey = Annotated[Optional[str], Field(
    description="attach mode only: the --api-key the attached server was started with (default: $EAGLE3_API_KEY "
                "if set, else none). A key given here is kept with the run's parameters in Prefect: prefer the "
                "environment variable. A launched server gets a random key of its own")]
ServerRidPrefix = Annotated[str, Field(
    description="attach mode only: the rid_prefix in the attached server's capture hook config (the hook's "
                f"default is {RID_PREFIX!r}); the hook captures only rids that start with it. A launched server "
                "gets a random prefix of its own")]
DumpDir = Annotated[Optional[str], Field(description="where the server writes captures (default: one dir per store "
                                                     "under /dev/shm)")]
MaxLength = Annotated[int, Field(description="longest sample in tokens", ge=1)]
BatchSize = Annotated[int, Field(description="samples per batch task and per shard", ge=1)]
StoreDtype = Annotated[Literal["bfloat16", "float8_e4m3fn"], Field(
    description="how the store keeps hidden states: bfloat16, or float8_e4m3fn with a per-token scale (half the "
                "bytes; readers still get bf16). Part of the store's identity")]
LedgerUrl = Annotated[Optional[str], Field(
    description="where a new store keeps its index: none = SQLite in the store (one machine); a postgresql:// URL, "
                "or 'env' for $EAGLE3_LEDGER_URL, = PostgreSQL (many writers; the password is never written into "
                "the store: give it in $EAGLE3_LEDGER_URL, PGPASSWORD or ~/.pgpass)")]

# Training.
DraftVocabSize = Annotated[int, Field(description="draft vocabulary: the N most frequent target tokens", ge=16)]
TttSteps = Annotated[int, Field(description="training-time-test unroll depth K (loss weights decay^k)", ge=1)]
Epochs = Annotated[int, Field(description="passes over the training split", ge=1)]
Lr = Annotated[float, Field(description="peak learning rate (AdamW, warm-up then cosine)", gt=0)]
TokensPerBatch = Annotated[int, Field(description="padded tokens per batch (one per device and accumulation step)",
                                       ge=64)]
Devices = Annotated[int, Field(description="GPUs to train on (per node); >1 runs torchrun", ge=1)]
Accumulate = Annotated[int, Field(description="batches per device and optimizer step (gradient accumulation): a step "
                                              "takes devices x nnodes x accumulate batches", ge=1)]
Sharding = Annotated[Literal["ddp", "fsdp", "hsdp"], Field(
    description="with more than one device: ddp (every GPU holds the whole drafter and its AdamW state), fsdp "
                "(weights, gradients and AdamW state sharded over all GPUs), hsdp (sharded within a node, "
                "replicated across nodes)")]
Nnodes = Annotated[int, Field(description="nodes to train on: run this flow on each, with the same parameters but "
                                          "node_rank, a shared out_dir and store", ge=1)]
NodeRank = Annotated[int, Field(description="this node, 0..nnodes-1: node 0's run holds out_dir's lock, checks the "
                                            "export and writes the artifacts; the others only train", ge=0)]
RdzvEndpoint = Annotated[Optional[str], Field(
    description="nnodes > 1: host:port of one of the nodes (the same on all), where torchrun's c10d rendezvous "
                "meets (e.g. node 0's address, a free port)")]
Precision = Annotated[Literal["auto", "fp32", "bf16"],
                      Field(description="auto: bf16 autocast on GPUs (fp32 weights, softmax and loss), fp32 on CPUs")]
VocabPositions = Annotated[int, Field(description="training positions (a seeded random subset) counted to pick the "
                                                  "draft vocabulary", ge=1)]
HeldoutFraction = Annotated[float, Field(description="share of samples held out (by sample-id hash)", gt=0, lt=1)]
ServeSteps = Annotated[int, Field(description="speculative steps the drafter will be served with (for tau@S)", ge=1)]
OnStoreChange = Annotated[Literal["refuse", "replan"], Field(
    description="a resume whose store has changed since the checkpoint (samples added, removed or altered): refuse "
                "(train in a new out_dir), or replan: start the current epoch again over the store as it is now")]
