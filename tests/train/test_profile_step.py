"""train.profile_step's attribution: the compiled step's HLO ops carry the model's name scopes (forward and
backward), kernels go to the part their op's scope names, and the per-step summary is a median over the steps."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from train.compilation import abstract
from train.configs import TINY
from train.profile_step import SCOPES, op_names, part_of, scope_of, summarize
from train.train import create_model, make_mesh, make_train_step


def test_the_compiled_step_names_every_scope_in_forward_and_backward():
    config = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, num_layers=1), batch_size=2, seq_len=16)
    with jax.set_mesh(make_mesh(1)):
        graphdef, state = nnx.split(create_model(config, "xla"))
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
        compiled = make_train_step(config, graphdef).trace(abstract(state), batch, batch).lower().compile()
    names = op_names(compiled.as_text())
    scopes = {scope_of(op_name) for op_name in names.values()}
    assert set(SCOPES) <= scopes and None in scopes  # and ops outside them: embedding, head, loss
    for scope in ("attention", "moe"):  # the backward's ops keep the scope inside transpose(...)
        assert any(scope_of(name) == scope and "transpose" in name for name in names.values()), scope


@pytest.mark.parametrize(
    ("kernel", "hlo_op", "part"),
    [
        ("moe_gmm_wgrad", "custom-call.3", "moe: moe_gmm_wgrad"),
        ("loop_fusion_7", "fusion.7", "moe: XLA"),
        ("loop_fusion_9", "", "attention"),  # no HLO op in the trace: the kernel is named after its fusion
        ("nvjet_tst_128x256", "dot.2", "optimizer"),
        ("input_reduce_fusion", "reduce.1", "other"),
        ("loop_add_fusion_4", "", "moe: XLA"),  # the fusion "loop_add_fusion.4" launches the kernel of that name
        ("nvjet_tst_64x64", "", None),  # neither an HLO op nor a fusion's name: unattributed
    ],
)
def test_a_kernel_goes_to_the_part_its_op_scope_names(kernel, hlo_op, part):
    names = {
        "fusion.7": "jit(train_step)/while/body/transpose(jvp(moe))/mul",
        "loop_fusion_9": "jit(train_step)/while/body/attention/dot_general",
        "dot.2": "jit(train_step)/optimizer/mul",
        "reduce.1": "jit(train_step)/while/body/reduce_sum",
        "custom-call.3": "jit(train_step)/moe/pallas_call",
    }
    names["loop_add_fusion_4"] = "jit(train_step)/moe/add"  # as op_names also keys "loop_add_fusion.4"
    assert part_of(kernel, hlo_op, names) == part


def test_op_names_key_each_instruction_also_by_its_kernel_name():
    text = '%loop_add_fusion.9 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/moe/add" source_line=3}'
    names = op_names(text)
    assert names["loop_add_fusion.9"] == names["loop_add_fusion_9"] == "jit(f)/moe/add"


def test_a_scope_is_a_whole_component_of_the_name_stack():
    assert scope_of("jit(f)/moe_norm/mul") is None
    assert scope_of("jit(f)/attention_norm/mul") is None
    assert scope_of("jit(f)/transpose(jvp(attention))/dot_general") == "attention"


def test_the_summary_is_the_median_over_steps():
    names = {"fusion.1": "jit(train_step)/moe/add", "fusion.2": "jit(train_step)/optimizer/add"}
    steps = [
        [("moe_gmm", 0, 3000, ""), ("f1", 1, 1000, "fusion.1"), ("f2", 2, 1000, "fusion.2")],
        [("moe_gmm", 0, 5000, ""), ("f1", 1, 1000, "fusion.1"), ("f2", 2, 2000, "fusion.2"), ("nvjet", 3, 500, "")],
        [("moe_gmm", 0, 4000, ""), ("f1", 1, 3000, "fusion.1"), ("f2", 2, 3000, "fusion.2")],
    ]
    summary = summarize(steps, names)
    assert summary["parts_us"] == {"moe: moe_gmm": 4.0, "optimizer": 2.0, "moe: XLA": 1.0, "other": 0.0}
    assert summary["kernel_us"] == 8.5  # the median step's total, not the sum of the medians (7)
    assert summary["our_kernels_share"] == pytest.approx(4.0 / 8.5)
    assert summary["unattributed_us"] == 0.0  # the one unattributed kernel ran in one step of three
    assert list(summary["top_kernels_us"]) == ["moe_gmm", "f2", "f1", "nvjet"]
