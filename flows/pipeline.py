"""Flow `eagle3_pipeline`: [regenerate answers] -> extract -> verify -> train
-> export -> evaluate (served in SGLang), each stage a subflow, on one
config whose sections are the stages' own.

    python -m flows.pipeline --help
    python -m flows.pipeline --config configs/pipeline.yaml --train.lr 3e-4
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows.config import checked, described
from flows.extract import extract_hidden_states, one_server
from flows.run_record import keep_run_config
from flows.stream import capture_and_train
from flows.evaluate import baseline_server, evaluate_drafter
from flows.regenerate import regenerate_answers
from flows.train import train_drafter
from flows.verify import verify_store
from tasks.capture.config import CaptureConfig
from tasks.regeneration.config import RegenerateConfig
from tasks.evaluation.config import EvaluateConfig
from tasks.evaluation.prompts import check_prompt_files
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.store.lock import hold_lock
from tasks.stream.plan import check_mode
from tasks.train.config import TrainConfig


def answers_dir(store_dir: Path) -> Path:
    """Where a pipeline's regenerated answers go by default: inside the store,
    which the run holds locked, so two pipelines on sibling stores never
    write each other's answers or server logs."""
    return store_dir / "regenerated"


@flow(name="eagle3_pipeline")
@described
@checked(check_mode)
def eagle3_pipeline(
    server: ServerConfig = ServerConfig(),
    capture: CaptureConfig = CaptureConfig(),
    store: StoreConfig = StoreConfig(),
    train: TrainConfig = TrainConfig(),
    evaluate: EvaluateConfig = EvaluateConfig(),
    regenerate: RegenerateConfig = RegenerateConfig(),
    mode: Annotated[Literal["offline", "stream"], Field(description=(
        "offline: capture everything, verify, then train; stream: train while the capture runs (the same "
        "batches and weights; wall time the longer side, not the sum)"))] = "offline",
    capture_nodes: Annotated[list[str], Field(description=(
        "stream mode: the work queues of capture nodes (python -m flows.node, one capture server each) that "
        "capture for the trainer instead of the server section's server; the store's index must be in "
        "PostgreSQL (store.ledger_url)"), max_length=64)] = [],
) -> dict:
    """From a dataset to a drafter SGLang serves: capture, verify, train, export, evaluate."""
    if evaluate.enabled:  # refused now, not after the training
        baseline_server(server, evaluate)
        check_prompt_files(evaluate.prompt_sets)
    log = get_run_logger()
    check_mode(mode, train, capture_nodes)  # as the command line does (a run from the UI is not resolved there)
    store_dir, train_dir = Path(store.path).resolve(), Path(train.out_dir).resolve()
    store = store.model_copy(update={"path": str(store_dir)})
    train = train.model_copy(update={"out_dir": str(train_dir)})
    # The run holds its store and train dir throughout, so no other run
    # writes them between extraction, verification and training; the
    # extract and train subflows re-enter these locks.
    # The store's lock names this run: capture nodes write under it.
    regenerated = None
    with hold_lock(store_dir, "eagle3_pipeline", run=flow_run.get_id()), hold_lock(train_dir, "eagle3_pipeline"):
        keep_run_config(store_dir / "runs", "eagle3_pipeline", store_dir)
        with ExitStack() as serving:
            capturing = server
            if regenerate.enabled:
                # One model load: the capture server the run launches answers
                # first (outside its rid prefix: served, not captured), unless
                # a server is attached (which does), or the capture runs
                # beside the training (stream mode: its capture stops its own
                # server when done, and the answers' server is gone by then).
                if not server.url and mode == "offline":
                    capturing, capture = serving.enter_context(one_server(server, capture, store_dir))
                answers = regenerate_answers(server=capturing, dataset=capture.dataset,
                                             regenerate=regenerate.model_copy(update={
                                                 "out": regenerate.out or str(answers_dir(store_dir))}))
                capture = capture.model_copy(update={"dataset": answers["out"]})
                regenerated = {k: answers.get(k) for k in ("out", "rows", "answer_tokens", "cut", "dropped",
                                                            "quarantined", "note")}
            if mode == "stream":
                to_serve = evaluate.num_prompts if evaluate.enabled and "heldout" in evaluate.prompt_sets else 0
                trained = capture_and_train(capturing, capture, store, train, tuple(capture_nodes),
                                            served_prompts=to_serve)
            else:
                extract_hidden_states(server=capturing, capture=capture, store=store, verify=False)
        # The server is down: training and the evaluation's servers get the devices.
        verify_store(store=str(store_dir))  # the whole store (in stream mode too) before it is trained on or served
        if mode != "stream":
            trained = train_drafter(store=str(store_dir), train=train, server=server)
        report = evaluate_drafter(drafter_dirs=[trained["drafter_dir"]], store=str(store_dir),
                                  server=server.model_copy(update={"model": trained["target"]}),
                                  evaluate=evaluate) if evaluate.enabled else None
    steps = train.serve_steps
    held = trained["heldout"]
    summary = {
        "store": str(store_dir), "drafter_dir": trained["drafter_dir"],
        "heldout_tau": held["tau"], f"heldout_tau@{steps}": held[f"tau@{steps}"],
        "heldout_tau_exact": held["tau_exact"], f"heldout_tau_exact@{steps}": held[f"tau_exact@{steps}"],
        "untrained_tau": trained["untrained"]["tau"], "regenerated": regenerated}
    if report is None:
        log.info("drafter %s: held-out tau %.2f (tau@%d %.2f, exact %.2f; untrained %.2f); not served "
                 "(evaluate.enabled false: python -m flows.evaluate measures it)", trained["drafter_dir"],
                 held["tau"], steps, held[f"tau@{steps}"], held[f"tau_exact@{steps}"], summary["untrained_tau"])
        return summary
    # The first prompt set, greedy; speeds at the fewest streams swept.
    served = next(r for r in report["acceptance"] if r["mode"] == "greedy")
    fewest = min(report["sweep"], key=lambda r: r["concurrency"])
    # With evaluate.simulate: the same set's acceptance per draft position, simulated and served.
    simulated = next((r for r in report["served_text"] if r["prompt_set"] == served["prompt_set"]), None)
    summary.update({
        "prompt_set": served["prompt_set"], "sglang_accept_length": served["pooled"],
        "sglang_accept_length_se": served["pooled_se"], "sglang_prompts": served["requests"],
        "sglang_accept_length_mean_of_means": served["mean_of_means"], "sglang_accept_rate": served["accept_rate"],
        "streams": fewest["concurrency"], "speedup": fewest["per_user_speedup"],
        "plain_tokens_per_s": fewest["plain_per_user_tokens_per_s"],
        "spec_tokens_per_s": fewest["spec_per_user_tokens_per_s"], "outputs_equal": served["outputs_equal"],
        "evaluation": report["out_dir"],
        "served_text": simulated and {k: simulated.get(k) for k in (
            "per_position", "gaps", "requests", "replay_equals_sglang", "target_agrees")},
    })
    log.info("drafter %s: held-out tau %.2f (tau@%d %.2f, exact %.2f; untrained %.2f); SGLang accept length "
             "%.2f pooled, %.2f mean of means on %s; speed-up %.2fx at %d stream(s), greedy outputs identical: %s",
             trained["drafter_dir"], held["tau"], steps, held[f"tau@{steps}"], held[f"tau_exact@{steps}"],
             summary["untrained_tau"], served["pooled"], served["mean_of_means"], served["prompt_set"],
             summary["speedup"] or 0.0, fewest["concurrency"], served["outputs_equal"])
    return summary


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(eagle3_pipeline, "python -m flows.pipeline")
