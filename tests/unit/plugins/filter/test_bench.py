"""inferops.vllm.bench_scenarios: benchmark scenarios refused before any request, and their vllm bench serve
command lines (plugins/filter/bench.py). The flags and dataset names are those of vLLM 0.32's
vllm/benchmarks/serve.py and datasets.py."""

from __future__ import annotations

import pytest
from ansible_collections.inferops.vllm.plugins.filter.bench import FilterModule, bench_scenarios

LIMITS = [{"label": "p1", "max_model_len": 1024}, {"label": "d1", "max_model_len": 512}]
OPTIONS = {"venv": "/opt/vllm/venv", "base_url": "https://10.0.0.5:8000", "model": "m", "tokenizer": "/models/m",
           "result_dir": "/tmp/x.inferops-bench",
           "metadata": {"configuration": "PD 1P+1D", "kv_dtype": "fp8", "prefix_caching": "on", "nothing": None}}
GOOD = {"name": "short", "dataset": "random", "input_len": 128, "output_len": 32, "num_prompts": 20, "rate": 2,
        "concurrency": 4}


def problems(*scenarios, limits=None):
    return bench_scenarios(list(scenarios), LIMITS if limits is None else limits, OPTIONS)["problems"]


def only(found, start):
    assert len(found) == 1, found
    assert found[0].startswith(start), found[0]
    return found[0]


def test_a_good_scenario_and_its_command_line():
    out = bench_scenarios([GOOD], LIMITS, OPTIONS)
    assert out["problems"] == [] and (out["max_model_len"], out["max_model_len_instance"]) == (512, "d1")
    (sc,) = out["scenarios"]
    assert (sc["max_prompt_tokens"], sc["max_output_tokens"], sc["expected_seconds"], sc["result_file"]) == (
        128, 32, 10.0, "short.json")
    assert sc["argv"] == [
        "/opt/vllm/venv/bin/vllm", "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", "https://10.0.0.5:8000", "--model", "m", "--tokenizer", "/models/m", "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "32", "--random-range-ratio", "0",
        "--random-prefix-len", "0", "--num-prompts", "20", "--request-rate", "2.0", "--burstiness", "1",
        "--max-concurrency", "4", "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
        "--result-dir", "/tmp/x.inferops-bench", "--result-filename", "short.json", "--label", "short", "--metadata",
        "scenario=short", "dataset=random", "max_prompt_tokens=128", "max_output_tokens=32", "rate=2.0",
        "concurrency=4", "seed=0", "configuration=PD 1P+1D", "kv_dtype=fp8", "prefix_caching=on"]


def test_the_run_seed_fills_unset_seeds_and_the_offset_moves_every_seed():
    """A second run (or the colocated runs after the PD runs) must not resend prompts the caches hold."""
    given = {**GOOD, "name": "given", "seed": 7}
    out = bench_scenarios([GOOD, given], LIMITS, {**OPTIONS, "seed": 1234})
    assert [sc["seed"] for sc in out["scenarios"]] == [1234, 7]
    seed_of = [sc["argv"][sc["argv"].index("--seed") + 1] for sc in out["scenarios"]]
    assert seed_of == ["1234", "7"] and "seed=1234" in out["scenarios"][0]["argv"]
    moved = bench_scenarios([GOOD, given], LIMITS, {**OPTIONS, "seed": 1234, "seed_offset": 1})
    assert [sc["seed"] for sc in moved["scenarios"]] == [1235, 8]


def test_other_datasets_and_defaults():
    prefix = {"name": "pre", "dataset": "prefix_repetition", "prefix_len": 256, "suffix_len": 64, "output_len": 16,
              "num_prompts": 20}
    out = bench_scenarios([prefix, {**GOOD, "name": "burst", "rate": "inf", "concurrency": None,
                                    "range_ratio": 0.5, "prefix_len": 64, "input_len": 200, "output_len": 20}],
                          LIMITS, OPTIONS)
    assert out["problems"] == []
    pre, burst = out["scenarios"]
    assert pre["num_prefixes"] == 10 and pre["max_prompt_tokens"] == 320 and pre["rate"] == "inf"
    assert "--prefix-repetition-num-prefixes" in pre["argv"] and "--max-concurrency" not in pre["argv"]
    # random with a range ratio: up to prefix_len + input_len x 1.5 prompt and output_len x 1.5 output tokens.
    assert (burst["max_prompt_tokens"], burst["max_output_tokens"], burst["expected_seconds"]) == (364, 30, None)


def test_sharegpt_needs_a_file_and_its_prompts_reach_1024_tokens(tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text("[]")
    share = {"name": "chat", "dataset": "sharegpt", "dataset_path": str(data), "output_len": 64, "num_prompts": 10}
    long = [{"label": "p1", "max_model_len": 4096}]
    out = bench_scenarios([share], long, OPTIONS)
    (sc,) = out["scenarios"]
    assert sc["max_prompt_tokens"] == 1024 and sc["remote_dataset_path"] == "/tmp/x.inferops-bench/dataset-chat.json"
    assert sc["argv"][sc["argv"].index("--dataset-path") + 1] == sc["remote_dataset_path"]
    only(problems(share), "[scenario] scenario 'chat': output_len: prompts of up to 1024 tokens (ShareGPT prompts")
    only(bench_scenarios([{**share, "dataset_path": "relative.json"}], long, OPTIONS)["problems"],
         "[scenario] scenario 'chat': dataset_path: is 'relative.json', not the absolute path of a file")


def test_a_prompt_longer_than_max_model_len_is_refused_naming_scenario_and_field():
    line = only(problems({**GOOD, "name": "long", "input_len": 500}),
                "[scenario] scenario 'long': input_len: prompts of up to 500 tokens (input_len 500) + up to 32 output "
                "tokens = 532 tokens, more than max_model_len 512 (d1, the smallest of the instances)")
    assert "Fix: keep prompt + output within 512 tokens" in line
    # Exactly max_model_len fits.
    assert problems({**GOOD, "input_len": 480}) == []
    only(problems({"name": "pre", "dataset": "prefix_repetition", "prefix_len": 400, "suffix_len": 100,
                   "output_len": 16, "num_prompts": 10}), "[scenario] scenario 'pre': prefix_len: prompts of up to 500")


@pytest.mark.parametrize("dataset", ["hf", "burstgpt", "custom", "nonsense", 3])
def test_an_unknown_dataset_is_refused(dataset):
    line = only(problems({**GOOD, "dataset": dataset}), "[scenario] scenario 'short': dataset: is ")
    assert "not a dataset that vllm bench serve runs offline here (random, prefix_repetition, sharegpt)" in line


@pytest.mark.parametrize(("field", "value", "what"), [
    ("num_prompts", 0, "is 0, not a positive whole number"),
    ("num_prompts", -3, "is -3, not a positive whole number"),
    ("output_len", 2.5, "is 2.5, not a positive whole number"),
    ("input_len", "many", "is 'many', not a positive whole number"),
    ("input_len", True, "is True, not a positive whole number"),
    ("concurrency", 0, "is 0, not a positive whole number"),
    ("rate", 0, "is 0, not a positive number of requests per second"),
    ("rate", -1, "is -1, not a positive number of requests per second"),
    ("rate", "fast", "is 'fast', not a positive number of requests per second"),
    ("burstiness", 0, "is 0, not a positive number"),
    ("range_ratio", 1, "is 1, not a number in [0, 1)"),
    ("seed", -1, "is -1, not a whole number >= 0"),
])
def test_bad_numbers_are_refused_naming_scenario_and_field(field, value, what):
    only(problems({**GOOD, field: value}), f"[scenario] scenario 'short': {field}: {what}")


def test_names_keys_and_shapes():
    only(problems({**GOOD, "name": "a b"}), "[scenario] vllm_benchmark_scenarios[0]: name: is 'a b'")
    only(problems(GOOD, GOOD), "[scenario] scenario 'short': name: is used by two scenarios")
    only(problems({**GOOD, "input_lenght": 4}), "[scenario] scenario 'short': input_lenght: is not a setting")
    only(problems({k: v for k, v in GOOD.items() if k != "input_len"}),
         "[scenario] scenario 'short': input_len: is missing")
    only(problems("x"), "[scenario] vllm_benchmark_scenarios[0]: (entry): is 'x', not a mapping")
    only(bench_scenarios([], LIMITS)["problems"], "[scenario] vllm_benchmark_scenarios: (list): is empty")
    only(problems({"name": "pre", "dataset": "prefix_repetition", "prefix_len": 8, "suffix_len": 8, "output_len": 8,
                   "num_prompts": 4}), "[scenario] scenario 'pre': num_prompts: is 4, fewer than num_prefixes 10")


def test_every_problem_at_once_and_no_command_line_then():
    out = bench_scenarios([GOOD, {**GOOD, "name": "bad", "rate": 0, "dataset": "random", "num_prompts": 0}],
                          LIMITS, OPTIONS)
    assert len(out["problems"]) == 2 and out["scenarios"] == []


def test_unknown_max_model_len_is_a_problem():
    line = only(bench_scenarios([GOOD], [{"label": "p1", "max_model_len": None}], OPTIONS)["problems"],
                "[instances] p1: vllm_instance_max_model_len: is 0 (the model's own)")
    assert "vllm_instance_model_facts" in line


def test_registered():
    assert FilterModule().filters()["bench_scenarios"] is bench_scenarios


# --------------------------------------------------------------------------- goodput (vllm bench serve --goodput)


def _goodput_argv(sc):
    argv = sc["argv"]
    if "--goodput" not in argv:
        return []
    start = argv.index("--goodput") + 1
    end = next(i for i in range(start, len(argv)) if argv[i].startswith("--"))
    return argv[start:end]


def test_goodput_slos_become_vllm_bench_serve_flags_and_metadata():
    """vLLM 0.32's --goodput takes KEY:VALUE pairs (ttft, tpot, e2el) in milliseconds, nargs='+'."""
    own = {**GOOD, "name": "own", "goodput": {"tpot_ms": 40, "ttft_ms": 250.5}}
    off = {**GOOD, "name": "off", "goodput": {}}
    out = bench_scenarios([GOOD, own, off], LIMITS, {**OPTIONS, "goodput": {"ttft_ms": 500, "e2el_ms": 9000}})
    assert out["problems"] == []
    default, mine, none = out["scenarios"]
    # The role's SLOs for a scenario without its own; a scenario's own replace them; {} turns them off.
    assert _goodput_argv(default) == ["ttft:500", "e2el:9000"]
    assert _goodput_argv(mine) == ["ttft:250.5", "tpot:40"]
    assert _goodput_argv(none) == [] and "--goodput" not in none["argv"]
    # The SLOs travel with the result, for the report's goodput column.
    assert "goodput_slos=ttft:250.5 tpot:40" in mine["argv"]
    assert not any(a.startswith("goodput_slos=") for a in none["argv"])
    # Without SLOs anywhere, no flag (the existing command line is unchanged).
    assert "--goodput" not in bench_scenarios([GOOD], LIMITS, OPTIONS)["scenarios"][0]["argv"]


@pytest.mark.parametrize(("goodput", "start"), [
    ({"ttft_ms": 0}, "[scenario] scenario 'short': goodput.ttft_ms: is 0, not a positive number of milliseconds."),
    ({"tpot_ms": -5}, "[scenario] scenario 'short': goodput.tpot_ms: is -5, not a positive number of milliseconds."),
    ({"ttft_ms": "fast"}, "[scenario] scenario 'short': goodput.ttft_ms: is 'fast', not a positive number"),
    ({"ttft_ms": True}, "[scenario] scenario 'short': goodput.ttft_ms: is True, not a positive number"),
    ({"ttft": 500}, "[scenario] scenario 'short': goodput.ttft: is not an SLO that vllm bench serve measures"),
    ("ttft:500", "[scenario] scenario 'short': goodput: is 'ttft:500', not a mapping of SLOs in milliseconds."),
])
def test_bad_goodput_slos_of_a_scenario_are_refused(goodput, start):
    line = only(problems({**GOOD, "goodput": goodput}), start)
    assert "Fix: " in line


@pytest.mark.parametrize(("slos", "start"), [
    ({"ttft_ms": -1}, "[goodput] vllm_benchmark_goodput_slos: ttft_ms: is -1, not a positive number of milliseconds"),
    ({"itl_ms": 5}, "[goodput] vllm_benchmark_goodput_slos: itl_ms: is not an SLO"),
    ([500], "[goodput] vllm_benchmark_goodput_slos: (mapping): is [500], not a mapping of SLOs"),
])
def test_bad_role_goodput_slos_are_refused_naming_the_variable(slos, start):
    out = bench_scenarios([GOOD], LIMITS, {**OPTIONS, "goodput": slos})
    line = only(out["problems"], start)
    assert "Fix: " in line and out["scenarios"] == []
