"""lm-evaluation-harness end to end, reduced (issue 29): the repository's offline tasks through
`--model hf` in this process and `--model local-completions` and `--model odmoe-completions`
against a real local cluster (its OpenAI API over TLS with a token), every document compared.
`odmoe-bench suite=eval` runs them in full on the trained model."""

from __future__ import annotations

import pytest

from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.extended]


def test_lm_eval_through_the_cluster_scores_as_one_process(model_dirs, tmp_path, reap_children):
    from odmoe_bench.suites import eval_harness

    cfg = BenchConfig(suite="eval", results_dir=str(tmp_path))
    cfg.eval.limit, cfg.eval.scoring_prompts, cfg.eval.scoring_batch = 4, 4, 2
    path = model_dirs["mixtral"]
    report = eval_harness.run(cfg, path, ResultsDir(cfg, path))
    mc, gen = report["tasks"]["odmoe_code_mc"], report["tasks"]["odmoe_code_gen"]
    assert mc["documents"] == gen["documents"] == 4
    # every choice's log-likelihood equals hf's to the bit once summed as hf sums
    assert mc["choices"] == mc["ll_equal_summed_in_float32"] == mc["greedy_equal"] == 16
    assert gen["generations_equal"] == 4
    assert all(a == b for a, b in mc["scores"].values()) and all(a == b for a, b in gen["scores"].values())
    assert mc["documents_differing"] == gen["documents_differing"] == 0 and report["identical"]
    # odmoe-completions (local-completions summing as hf sums) reports hf's log-likelihoods as they are
    mc2, gen2 = report["odmoe_completions"]["odmoe_code_mc"], report["odmoe_completions"]["odmoe_code_gen"]
    assert mc2["choices"] == mc2["ll_equal_as_reported"] == mc2["greedy_equal"] == 16
    assert mc2["documents_differing"] == gen2["documents_differing"] == 0 and gen2["generations_equal"] == 4
    assert all(v > 0 for k, v in report["scoring"].items() if "tokens/s" in k or "," in k)
    assert (tmp_path / "eval.json").is_file()
