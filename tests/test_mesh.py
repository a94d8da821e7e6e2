"""Sharded load, prefill, decode and generate over a jax Mesh of 8 CPU devices, against one device.

The runs happen in one subprocess (tests/mesh_worker.py: jax must see 8 host devices from its start,
this process has one), started by conftest when these tests are collected so that it runs beside the
rest of the suite; the tests here (run last) check its report. Meshes (expert=4, tensor=2), (tensor=8),
(data=2, expert=4) and one device; a tiny checkpoint with every layer kind, grouped routing and
latent MoE in bf16, FP8 and NVFP4, loaded in float32: greedy tokens must be identical to one device
(the sums split over devices differ from one device's by rounding only: logits agree to ~1e-6).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import MESH_WORKER
from mesh_worker import FORMATS, MESHES


@pytest.fixture(scope="module")
def report(request) -> dict:
    """The worker's report; conftest starts the worker at collection, so it has run beside the suite."""
    proc, out = request.config.stash[MESH_WORKER]
    try:
        returncode = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert returncode == 0, (out / "stderr").read_text()[-4000:]
    return json.loads((out / "report.json").read_text())


def test_the_worker_saw_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_greedy_tokens_equal_one_device(report, fmt, mesh):
    runs = report["formats"][fmt]
    assert runs["meshes"][mesh]["tokens"] == runs["reference"]
    assert len(runs["reference"]) == 3 and all(len(t) == 12 for t in runs["reference"])


def test_sharded_forward_logits_match_one_device(report):
    assert report["formats"]["NVFP4"]["meshes"]["expert4_tensor2"]["logits_rel_err"] < 1e-5


# NVFP4 leaves (experts_down's block scales transposed [E, F/16, L]) and carry leaves, by mesh
NAMED = {
    "expert4_tensor2": {
        "experts_up.packed": "P('expert', 'tensor', None)", "experts_down.scale": "P('expert', 'tensor', None)",
        "experts_down.scale.shard": [2, 4, 64], "in_proj.scale": "P('tensor', None)",
        "out_proj.packed": "P(None, 'tensor')", "ssm": "P(None, 'tensor')", "conv": "P(None, None, 'tensor')",
        "kv_pages": "P()", "tokens": "P()", "logits": "P(None, 'tensor')", "embed": "P('tensor', None)"},
    "tensor8": {
        "experts_up.packed": "P(None, 'tensor', None)", "experts_down.scale": "P(None, 'tensor', None)",
        "experts_down.scale.shard": [8, 1, 64], "in_proj.scale": "P('tensor', None)",
        "out_proj.packed": "P(None, 'tensor')", "ssm": "P(None, 'tensor')", "conv": "P(None, None, 'tensor')",
        "kv_pages": "P()", "tokens": "P()", "logits": "P(None, 'tensor')", "embed": "P('tensor', None)"},
    "data2_expert4": {
        "experts_up.packed": "P('expert', None, None)", "experts_down.scale": "P('expert', None, None)",
        "experts_down.scale.shard": [2, 8, 64], "in_proj.scale": "P(None, None)", "out_proj.packed": "P(None, None)",
        "ssm": "P('data',)", "conv": "P('data',)", "kv_pages": "P('data',)", "tokens": "P('data',)",
        "logits": "P('data',)", "embed": "P(None, None)"},
}


@pytest.mark.parametrize("mesh", NAMED)
def test_param_and_carry_leaves_are_sharded(report, mesh):
    runs = report["formats"]["NVFP4"]["meshes"][mesh]
    assert runs["named"] == NAMED[mesh]
    assert runs["carry_specs"] == runs["prefill_carry_specs"]  # decode keeps the layout prefill made


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_decode_is_one_compiled_program(report, fmt, mesh):
    """generate compiles one prefill and one decode program on the mesh (every step reuses it: the carry
    keeps the layout prefill made; it compiles beside prefill, on the worker thread); another request in the
    same buckets compiles neither again."""
    runs = report["formats"][fmt]["meshes"][mesh]
    assert runs["compiled_first"].count("jit(_decode)") == 1 and runs["compiled_first"].count("jit(_prefill)") == 1
    assert runs["decode_compiled_on"][0].startswith("nemoh-decode-compile"), runs["decode_compiled_on"]
    assert not {"jit(_decode)", "jit(_prefill)"} & set(runs["compiled_again"]), runs["compiled_again"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_device_mesh_splits_nothing(report, fmt):
    runs = report["formats"][fmt]["meshes"]["one_device"]
    assert all("'" not in spec for spec in runs["param_specs"] + runs["carry_specs"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mesh", MESHES)
def test_each_tensor_and_expert_is_read_once(report, fmt, mesh):
    runs = report["formats"][fmt]["meshes"][mesh]
    per_expert = {"bf16": 1, "FP8": 2, "NVFP4": 3}[fmt]  # weight (+ weight_scale, + weight_scale_2)
    assert runs["max_reads"] == 1
    assert sorted(set(runs["expert_reads"].values())) == [1]
    assert len(runs["expert_reads"]) == 2 * 8 * per_expert  # up and down of 8 experts, one MoE layer


ERRORS = {
    "load": ("MeshError", r"tensor layers\[2\]\.experts_down\.scale \(block scales, transposed: \[\.\.\., in/16, out\]\) "
                          r"\[8, 4, 64\]: dim 1 \('expert_mlp', size 4\) does not divide over mesh axis 'tensor' of size 8"),
    "random_params": ("MeshError", r"layers\[2\]\.experts_down\.scale .* dim 1 .* mesh axis 'tensor' of size 8"),
    "generate": ("MeshError", r"layers\[2\]\.experts_down\.scale .* dim 1 .* mesh axis 'tensor' of size 8"),
    "num_pages": ("MeshError", r"tensor carry\.states\[1\]\.k \[7, 4, 2, 16\]: dim 0 \('pages', size 7\) does not "
                               r"divide over mesh axis 'data' of size 2"),
    "hidden_split": ("MeshError", r"'hidden' splits over mesh axes \('tensor',\)"),
    "not_a_mesh": ("RequestError", r"mesh=\[\['cpu'\]\]: must be a jax\.sharding\.Mesh"),
    "mamba_groups": ("MeshError", r"Mamba n_groups=2 does not divide over mesh axis \('tensor',\) of size 8"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_mesh_raises_a_named_error_before_any_device_work(report, case):
    got = report["errors"][case]
    kind, pattern = ERRORS[case]
    assert got["type"] == kind and re.search(pattern, got["message"]), got
    assert got["new_arrays"] == 0
    if case == "load":
        assert got["reads"] == 0  # not one tensor read


def test_kernels_run_per_device_only(report):
    assert report["kernel_choice"] == {"sharded program": True, "shard_map body": False, "outside": False}
