"""distlab.results: what a saved benchmark records about the conditions it ran in, and the one rule that says
whether its timings are faithful (a figure of an unfaithful result says so in its title)."""

import json

from distlab import results


def _saved(tmp_path, data, **conditions):
    results.save("probe", data, "summary", directory=tmp_path, **conditions)
    return json.loads((tmp_path / "probe.json").read_text(encoding="utf-8"))


def test_a_saved_result_records_the_load_and_the_ranks_and_threads_it_was_given(tmp_path):
    saved = _saved(tmp_path, {"x": 1}, ranks=2, threads_per_rank=1)
    machine = saved["machine"]
    assert machine["ranks"] == 2 and machine["threads_per_rank"] == 1
    assert machine["cores_per_rank"] == round(machine["cpus"] / 2, 2)
    assert isinstance(machine["load_average"], float) and machine["load_average"] >= 0
    assert "ranks" not in _saved(tmp_path, {"x": 1})["machine"]  # only what the benchmark said


def _result(cpus=2, load=0.5, ranks=2, **data):
    return dict(data, machine={"cpus": cpus, "load_average": load, "ranks": ranks})


def test_one_rule_judges_every_result_and_names_each_reason():
    assert results.faithfulness(_result()) == (True, "")
    assert results.faithfulness(_result(ranks=4)) == (False, "4 ranks on 2 cores took turns")
    busy = results.faithfulness(_result(load=20.84))
    assert busy == (False, "the machine was busy (load average 20.8 on 2 cores)")
    assert results.faithfulness(_result(load=2.9))[0]  # its own 2 ranks and their threads are expected load
    assert results.faithfulness(_result(load=99, faithful=True, load_average=0.3))[0]  # a load it measured wins
    own = results.faithfulness(_result(faithful=False, unfaithful_reason="backward ran faster than forward"))
    assert own == (False, "backward ran faster than forward")
    per_degree = results.faithfulness(_result(ranks=4, faithful={"1": True, "2": True, "4": False}))
    assert per_degree == (False, "its runs at 4 had more ranks than cores")
    gpu = dict(_result(ranks=8, load=50), machine={"cpus": 2, "load_average": 50, "ranks": 8, "gpus": ["H100"] * 8})
    assert results.faithfulness(gpu)[0]  # GPU ranks do not take turns on CPU cores


def test_a_figure_of_an_unfaithful_result_says_so_in_its_title_and_the_description_too():
    assert results.title(_result(), "step time") == "step time"
    assert results.title(_result(ranks=4), "step time") == "step time\nnot faithful: 4 ranks on 2 cores took turns"
    described = results.describe(dict(_result(ranks=4), machine=dict(_result(ranks=4)["machine"], threads_per_rank=1)))
    assert ", 4 ranks × 1 thread(s)," in described
    assert described.endswith("; not faithful: 4 ranks on 2 cores took turns")
