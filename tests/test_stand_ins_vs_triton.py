"""The CPU stand-ins of tasks.server.cpu.spec_ops mean what SGLang's GPU
kernels mean: each is run against the Triton kernel SGLang 0.5.23 runs for
the same job on a GPU, on the same inputs, the kernel under Triton's
interpreter (tests/stand_ins_vs_triton.py holds the checks; they run once,
in one child process, via tests/triton_interpreter.py). Starts no server.

Integer bookkeeping must be exactly equal. Attention must agree to the
rounding its arithmetic allows (tolerances derived below). And every check
carries a negative control: the stand-in fed one wrong input must DISAGREE
with the kernel by more than that tolerance, so a comparison that compared
nothing, or compared too loosely to see a real mistake, fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.triton_interpreter import run

CHECKS_MODULE = "tests.stand_ins_vs_triton"
CHECKS = [
    "assign_req_to_token_pool_check",
    "assign_extend_cache_locs_check",
    "assign_draft_cache_locs_contiguous_check",
    "build_draft_decode_metadata_check",
    "fill_accept_out_cache_loc_check",
    "fill_bonus_tokens_check",
    "copy_all_layer_kv_cache_check",
    "build_tree_kernel_efficient_check",
    "verify_tree_greedy_check",
    "decode_attention_check",
    "mla_decode_attention_check",
    "extend_attention_check",
]

# fp32: both sides compute softmax attention in fp32 from the same inputs but
# sum in different orders (blocked tl.dot, split-KV partial softmaxes merged
# by log-sum-exp, online rescaling; against one einsum and one softmax). At
# fp32's unit roundoff 6e-8, dot products of up to 576 terms and outputs of
# order 1-3 the checks see at most 1.4e-6 (the MLA case; <= 7e-7 the rest),
# i.e. some 20 roundoffs. 1e-5 leaves ~7x room over that, so no reordering
# of the sums can trip it; and it is 4 orders of magnitude below what a
# change of meaning does (the controls: one token too few moves outputs by
# 0.45 or more), and 100x below even a 0.1% slip in the softmax scale (which
# moves these outputs by ~1.5e-3). Tighter would test summation order, not meaning.
FP32_TOLERANCE = 1e-5


def bf16_tolerance(facts: dict) -> float:
    """Both sides round their result to bf16 once, each within half a bf16
    ulp; at any element that is at most one ulp apart, <= 2**-7 * max|out|
    (bf16 keeps 8 significant bits). The Triton kernels also round the
    softmax weights p to bf16 before multiplying by V (tl.dot(p.to(v.dtype), v),
    decode_attention.py:762, extend_attention.py:712/868), a relative error
    <= 2**-8 per weight, so <= 2**-8 * max|V| on an output. The checks see
    exactly one ulp (7.8e-3 at outputs of 1-2, 1.6e-2 at 2-4), against a
    bound of ~0.03 here and controls >= 0.45. The fp32 cases carry the
    semantics at 1e-5; these check the bf16 path on top."""
    return 2 ** -7 * facts["max_abs_out"] + 2 ** -8 * facts["max_abs_v"]


@pytest.fixture(scope="module")
def results():
    return run(CHECKS_MODULE, CHECKS)


def facts_of(results: dict, check: str) -> dict:
    facts = results[check]
    assert "error" not in facts, f"{check} raised in the interpreter's child: {facts['error']}"
    return facts


def assert_exactly_equal(facts: dict, what: str, written_in_full: bool = True) -> None:
    """The kernel's and the stand-in's outputs equal; the compared part not
    empty and (where the kernel writes all of it) left at no sentinel; and
    every negative control differing."""
    assert facts["compared"] > 0, f"{what}: nothing compared"
    assert facts["equal"], f"{what}: stand-in differs from the Triton kernel at [index, kernel, stand-in] " \
                           f"{facts['first_mismatches']}"
    if written_in_full:
        assert facts["triton_wrote_all"], f"{what}: the Triton kernel left entries unwritten"
    assert facts["controls_equal"] and not any(facts["controls_equal"].values()), \
        f"{what}: a negative control equals the kernel too, so this comparison cannot fail: {facts['controls_equal']}"


def assert_within(facts: dict, tolerance: float, what: str) -> None:
    """max |kernel - stand-in| within tolerance, and every negative control
    at least 10x outside it: a wrong input moves outputs by far more than
    rounding does, so a tolerance this loose would still have caught it."""
    context = f"{what}: {facts}"
    assert facts["finite"] and facts["compared"] > 0, context
    assert facts["max_abs_diff"] <= tolerance, f"stand-in differs from the Triton kernel by more than " \
                                               f"{tolerance:.3g}: {context}"
    assert facts["controls"], context
    for name, diff in facts["controls"].items():
        assert diff > 10 * tolerance, f"negative control {name} is within 10x the tolerance: {context}"


def test_every_check_in_the_checks_module_is_run():
    # Read as text: importing the module here would load triton without the interpreter.
    source = (Path(__file__).parent / "stand_ins_vs_triton.py").read_text()
    assert sorted(re.findall(r"^def (\w+_check)\(", source, re.M)) == sorted(CHECKS)


# ------------------------------------------------------- slot bookkeeping

def test_assign_req_to_token_pool_writes_the_slots_the_triton_kernel_writes(results):
    assert_exactly_equal(facts_of(results, "assign_req_to_token_pool_check"), "assign_req_to_token_pool")


def test_assign_extend_cache_locs_reads_the_slots_the_triton_kernel_reads(results):
    assert_exactly_equal(facts_of(results, "assign_extend_cache_locs_check"), "assign_extend_cache_locs")


def test_assign_draft_cache_locs_contiguous_reserves_the_slots_the_triton_kernel_reserves(results):
    assert_exactly_equal(facts_of(results, "assign_draft_cache_locs_contiguous_check"),
                         "assign_draft_cache_locs_contiguous")


@pytest.mark.parametrize("topk", [1, 2])
def test_build_draft_decode_metadata_gives_each_branch_the_kv_slots_generate_draft_decode_kv_indices_gives(
        results, topk):
    facts = facts_of(results, "build_draft_decode_metadata_check")[f"topk{topk}"]
    # The stand-in is compared on the kernel's kv_indptr ranges; those must be what they are taken to be.
    assert facts["kv_indptr_is_cumsum_of_seq_len_plus_step"], facts
    assert_exactly_equal(facts, f"build_draft_decode_metadata topk {topk}")


def test_fill_accept_out_cache_loc_compacts_the_accepted_slots_as_the_triton_kernel_does(results):
    assert_exactly_equal(facts_of(results, "fill_accept_out_cache_loc_check"), "fill_accept_out_cache_loc")


def test_fill_bonus_tokens_picks_the_bonus_token_the_triton_kernel_picks(results):
    assert_exactly_equal(facts_of(results, "fill_bonus_tokens_check"), "fill_bonus_tokens")


def test_copy_all_layer_kv_cache_copies_the_bytes_the_tiled_triton_kernel_copies(results):
    facts = facts_of(results, "copy_all_layer_kv_cache_check")
    assert facts["triton_changed_the_buffers"], "the Triton copy changed nothing: the comparison would be vacuous"
    assert_exactly_equal(facts, "copy_all_layer_kv_cache (raw bits)", written_in_full=False)


# ------------------------------------------------------------ draft tree

@pytest.mark.parametrize("mode", ["FULL_MASK", "QLEN_ONLY"])
def test_build_tree_kernel_efficient_builds_the_tree_the_triton_kernel_builds(results, mode):
    facts = facts_of(results, "build_tree_kernel_efficient_check")[mode]
    for output, f in facts.items():
        what = f"build_tree_kernel_efficient {mode} {output}"
        assert f["compared"] > 0 and f["equal"], f"{what}: [index, kernel, stand-in] {f['first_mismatches']}"
        if output in ("positions", "retrive_index"):  # the rest may rightly keep their -1 / True pre-fill
            assert f["triton_wrote_all"], f"{what}: the Triton kernel left entries unwritten"
        # retrive_index is b * n + i whatever the tree: no wrong input changes it.
        if output != "retrive_index":
            # Each control is wrong in what it changes: a longer prefix moves positions, not links.
            assert not all(f["controls_equal"].values()), f"{what}: no negative control differs {f}"


def test_verify_tree_greedy_accepts_the_path_the_triton_kernel_accepts(results):
    facts = facts_of(results, "verify_tree_greedy_check")
    assert facts["accept_token_num_triton"] == [3, 1], "the inputs were made to accept 3 drafts, then 1"
    # predicts is written only where a token was accepted, accept_index past the path keeps its -1.
    assert_exactly_equal(facts["predicts"], "verify_tree_greedy predicts", written_in_full=False)
    assert_exactly_equal(facts["accept_index"], "verify_tree_greedy accept_index", written_in_full=False)
    assert_exactly_equal(facts["accept_token_num"], "verify_tree_greedy accept_token_num")


# ---------------------------------------------------------------- attention

DECODE_CASES = [f"{layout}-{dtype}-d{d}" for layout in ("gqa", "mha") for dtype in ("float32", "bfloat16")
                for d in (64, 128)]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention_matches_the_triton_decode_kernel_to_rounding(results, case):
    facts = facts_of(results, "decode_attention_check")[case]
    tolerance = FP32_TOLERANCE if "float32" in case else bf16_tolerance(facts)
    assert_within(facts, tolerance, f"decode_attention {case}")


def test_decode_attention_over_an_mla_latent_cache_matches_the_triton_mla_decode_to_rounding(results):
    facts = facts_of(results, "mla_decode_attention_check")["float32-kv_lora512-rope64"]
    assert facts["compared"] == 2 * 2 * 512, "the output has the latent's 512 value columns, not 576"
    assert_within(facts, FP32_TOLERANCE, "MLA decode_attention, kv_lora 512 + rope 64, float32")


@pytest.mark.parametrize("case", ["causal-float32", "tree-float32", "causal-bfloat16", "tree-bfloat16"])
def test_extend_attention_matches_the_triton_extend_kernel_to_rounding(results, case):
    facts = facts_of(results, "extend_attention_check")[case]
    if case.startswith("tree"):  # a tree mask ignored would show here
        assert "causal_instead_of_tree" in facts["controls"], facts
    tolerance = FP32_TOLERANCE if "float32" in case else bf16_tolerance(facts)
    assert_within(facts, tolerance, f"extend_attention {case}")
