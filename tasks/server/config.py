"""The capture server's settings, as a user gives them: which model, how it
is laid out over devices, and what SGLang gets beside that; or the URL of a
capture server the user started, to attach to. The launcher takes this
section inside its LaunchSpec (tasks/server/launch.py); the supervisor takes
it for attach mode and relaunches (tasks/server/supervisor.py)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, Field, SecretStr, field_validator, model_validator

from tasks.capture.dump import RID_PREFIX, check_rid_prefix
from tasks.config import Section
from tasks.target.models import SMOLLM2


def revealed(key: SecretStr | str | None) -> str | None:
    """A key as the server wants it on a request."""
    return key.get_secret_value() if isinstance(key, SecretStr) else key


# Where the key of a server the user started with --api-key comes from when
# no key is given: unlike a flow parameter, it is not stored with the run.
API_KEY_ENV = "EAGLE3_API_KEY"
MASK = str(SecretStr("key"))  # what pydantic writes in a key's place: a dumped config, Prefect's record


def api_key_type(env: str):
    """An optional API key that refuses the mask: a config saved from a run
    or its Prefect record has the mask where the key was, and sent as a key
    it gets a 401 far from the cause. `env`: the variable that can hold it."""
    def not_masked(key: SecretStr | None) -> SecretStr | None:
        if key is not None and key.get_secret_value() == MASK:
            raise ValueError(f"{MASK!r} is the mask a saved config or Prefect's record shows in place of a key, "
                             f"not the key: give the key itself, or leave it out and set ${env}")
        return key
    return Annotated[Optional[SecretStr], AfterValidator(not_masked)]


class ServerConfig(Section):
    """The capture server: the target it serves, how it is laid out over devices, the SGLang flags beside
    that; or the URL of one you started, to attach to."""

    model: str = Field(SMOLLM2, description=f"target model: a checkpoint folder, or {SMOLLM2!r} (the demo's, "
                                            "converted on first use)")
    url: Optional[str] = Field(None, description="attach to this running capture server instead of launching one")
    # A SecretStr: Prefect stores a run's parameters as JSON, where pydantic
    # writes it masked; a subflow called in the same process gets the key.
    api_key: api_key_type(API_KEY_ENV) = Field(None, description=(
        "attach mode only: the --api-key the attached server was started with (default: $EAGLE3_API_KEY if set, "
        "else none). Prefect keeps it masked with the run's parameters; the environment variable keeps it out "
        "of them altogether. A launched server gets a random key of its own"))
    rid_prefix: str = Field(RID_PREFIX, description=(
        "attach mode only: the rid_prefix in the attached server's capture hook config (the hook's default is "
        f"{RID_PREFIX!r}); the hook captures only rids that start with it. A launched server gets a random "
        "prefix of its own"))
    tp_size: int = Field(1, ge=1, description="tensor-parallel size of a launched server")
    dp_size: int = Field(1, ge=1, description=(
        "data-parallel size of a launched server: replicas of the model, tp_size devices each; with dp_attention, "
        "the attention groups inside the tp_size devices"))
    dp_attention: bool = Field(False, description=(
        "data-parallel attention: dp_size attention groups, each serving its own requests, over the tp_size "
        "devices, the FFN still tensor-parallel (SGLang's --attn-dp-size, formerly --dp-size N "
        "--enable-dp-attention). Needs dp_size > 1 dividing tp_size"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "compute dtype of a launched server: auto = the checkpoint's, or float32 on a CPU without fast bf16 (the "
        "store keeps bf16 either way)"))
    max_total_tokens: int = Field(65536, ge=1, description="KV pool size of a launched server, in tokens")
    chunked_prefill_size: Optional[int] = Field(None, ge=-1, description=(
        "SGLang chunked prefill size in tokens, -1 for none (default: SGLang's)"))
    mem_fraction_static: Optional[float] = Field(None, gt=0, le=1, description=(
        "share of device memory for the weights and the KV pool (default: SGLang's)"))
    extra_args: list[str] = Field([], description=(
        "extra arguments for sglang.launch_server (a flag the launcher sets from another setting is refused, "
        "naming that setting)"))
    max_restarts: int = Field(2, ge=0, description="relaunches of a crashed launched server")
    attach_wait_s: float = Field(0.0, ge=0, description=(
        "an attached server that stops answering: how long a batch waits for it to serve again (its owner "
        "relaunching it, as a node does for its runs) before it fails"))

    @property
    def ranks(self) -> int:
        """The devices (model processes) a launched server of this section
        takes: data-parallel attention splits the tensor-parallel ranks,
        replicas multiply them."""
        return self.tp_size * (1 if self.dp_attention else self.dp_size)

    @property
    def attention_tp(self) -> int:
        """Ranks each attention group's heads are split over (the whole
        tensor-parallel group without data-parallel attention)."""
        return self.tp_size // self.dp_size if self.dp_attention else self.tp_size

    @field_validator("rid_prefix", mode="before")
    @classmethod
    def _usable_rid_prefix(cls, prefix):
        return check_rid_prefix(prefix)

    @field_validator("chunked_prefill_size")
    @classmethod
    def _not_zero(cls, size):
        if size == 0:
            raise ValueError("a chunk of 0 tokens: give a positive size, or -1 to turn chunked prefill off")
        return size

    @model_validator(mode="after")
    def _consistent(self):
        if self.url is None and (self.api_key is not None or self.rid_prefix != RID_PREFIX):
            raise ValueError("server.api_key and server.rid_prefix are for attaching to a server you started "
                             "(server.url); a launched server draws its own")
        # SGLang 0.5.23 turns `--dp-size N --enable-dp-attention` into
        # `--attn-dp-size N` (arg_groups/parallel_hook.py,
        # handle_deprecated_dp_attention), then checks the groups fit.
        if self.dp_attention and self.dp_size == 1:
            raise ValueError("server.dp_attention needs server.dp_size > 1, the number of attention groups: SGLang "
                             "reads '--dp-size 1 --enable-dp-attention' as '--attn-dp-size 1', no data-parallel "
                             "attention at all")
        if self.dp_attention and self.tp_size % self.dp_size:
            raise ValueError(f"server.dp_attention splits the server.tp_size {self.tp_size} devices into "
                             f"server.dp_size {self.dp_size} attention groups, which does not divide them: SGLang "
                             "0.5.23 requires 'tp_size % attn_dp_size == 0' (handle_data_parallelism in "
                             "sglang/srt/arg_groups/parallel_hook.py)")
        return self
