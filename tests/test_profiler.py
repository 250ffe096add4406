"""The profiler measures exactly what autograd keeps and what crosses a cut."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from planner import Plan
from profiler import InputError, Profile, profile_model
from profiler.examples import mlp, transformer
from tests.conftest import quick_profile, synthetic_profile

F32 = 4


class TinyAttention(nn.Module):
    """Single-head attention with separate projections: easy to count by hand."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        p = (q @ k.transpose(-2, -1)).softmax(-1)
        return p @ v


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x[:, :3].sin()


class Join(nn.Module):
    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xy
        return x[:, :3] + y


def quick(
    model: nn.Module, sample: torch.Tensor, sizes: list[int], overhead: bool = False
) -> Profile:
    """Each layer's own figures (`overhead`: also the runtime's costs, and each backward then
    without the autograd call a stage makes once, which can leave a tiny layer's at 0)."""
    return profile_model(
        model, sample, batch_sizes=sizes, repeats=1, warmup=0, progress=False, overhead=overhead
    )


def test_linear_relu_linear_saved_and_output_bytes_are_exact():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5))
    prof = quick(model, torch.randn(4, 4), [1, 2, 4])
    lin1, relu, lin2 = prof.layers
    for b in (1, 2, 4):
        assert lin1.saved_bytes[b] == b * 4 * F32  # the input, kept for the weight gradient
        assert relu.saved_bytes[b] == b * 3 * F32  # its result
        assert lin2.saved_bytes[b] == b * 3 * F32  # its input: the very tensor ReLU saved
        assert lin2.shared_bytes[b] == b * 3 * F32
        assert lin1.shared_bytes[b] == relu.shared_bytes[b] == 0
    assert [x.output_bytes for x in prof.layers] == [3 * F32, 3 * F32, 5 * F32]
    assert [x.output_shape for x in prof.layers] == [[[3]], [[3]], [[5]]]
    assert [x.param_bytes for x in prof.layers] == [(12 + 3) * F32, 0, (15 + 5) * F32]
    assert relu.backward_weight_ms[4].median == 0.0  # no weights
    assert lin1.backward_input_ms[4].median == 0.0  # the model's input needs no gradient
    assert lin2.backward_weight_ms[4].median > 0 and lin2.backward_input_ms[4].median > 0
    assert prof.input_bytes == 4 * F32


class Widen(nn.Module):
    """Two unsaved temporaries, the second saved by the Linear, whose product is 4x wider."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 4 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin((x * 2) * 3)


class Doubled(nn.Module):
    """Saves nothing (a product with a number keeps no tensor for backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_the_forward_up_to_its_last_save_is_where_a_checkpoint_stops():
    """stop_transient_bytes: what a layer allocates beyond what it saves, up to the moment it
    saves its last tensor (torch's checkpoint re-runs a stage no further). Widen: x * 2 (one
    unit), then its product by 3 (saved by the Linear) beside it; the Linear's 4-unit output
    comes after its last save. A layer that saves nothing stops nowhere: its whole forward."""
    d, t = 8, 16
    prof = quick(nn.Sequential(Widen(d), Doubled(), nn.Linear(4 * d, d)), torch.randn(2, t, d),
                 [1, 2])  # fmt: skip
    widen, doubled, lin = prof.layers
    for b in (1, 2):
        unit = b * t * d * F32
        # (and the numbers 2 and 3, each a scalar tensor while its product is made)
        assert unit <= widen.stop_transient_bytes[b] <= unit + 16
        assert widen.forward_transient_bytes[b] == 4 * unit
        assert doubled.stop_transient_bytes[b] == doubled.forward_transient_bytes[b]
        assert 4 * unit <= doubled.forward_transient_bytes[b] <= 4 * unit + 16
        assert (lin.stop_transient_bytes[b], lin.forward_transient_bytes[b]) == (0, unit)


class _Square(torch.autograd.Function):
    """x * x, keeping x for backward as `keep` says: on ctx as an attribute ("ctx", as older
    extensions do), in a list on ctx ("list"), or through save_for_backward ("saved"); "wide":
    on ctx, and beside it a tensor of its own 16x as wide, kept as well."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: str) -> torch.Tensor:  # type: ignore[override]
        ctx.keep = keep
        if keep in ("ctx", "wide"):
            ctx.x = x
        elif keep == "list":
            ctx.held = [x, 2]
        else:
            ctx.save_for_backward(x)
        if keep == "wide":
            ctx.wide = {"kept": [x.repeat(1, 16)]}
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        x = {"ctx": lambda: ctx.x, "wide": lambda: ctx.x, "list": lambda: ctx.held[0]}.get(
            ctx.keep, lambda: ctx.saved_tensors[0]
        )()
        return 2 * x * g, None


class Square(nn.Module):
    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Square.apply(x, self.keep)


@pytest.mark.parametrize("keep", ["ctx", "list"])
def test_a_tensor_kept_on_a_custom_functions_ctx_counts_as_saved(keep):
    """Found by a red team: a custom autograd.Function that keeps its input as an attribute of
    ctx is seen by no saved-tensor hook, so the profile said it saved nothing, and its plans
    ran 5-20% over. Its figures now equal those of the same layer saving through
    save_for_backward: the Linear's output, which the Linear after it saves too."""

    def figures(k: str) -> list[tuple]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 32), Square(k), nn.Linear(32, 4))
        prof = quick(model, torch.randn(2, 4), [1, 2])
        return [(x.saved_bytes, x.shared_bytes, x.input_saved_bytes) for x in prof.layers]

    held, saved = figures(keep), figures("saved")
    assert held == saved
    assert held[1] == ({1: 32 * F32, 2: 64 * F32}, {1: 0, 2: 0}, {1: 32 * F32, 2: 64 * F32})


def test_layernorm_saves_input_mean_and_rstd():
    t, d = 5, 6
    prof = quick(nn.Sequential(nn.LayerNorm(d)), torch.randn(2, t, d), [1, 2])
    (ln,) = prof.layers
    for b in (1, 2):
        assert ln.saved_bytes[b] == b * t * d * F32 + 2 * b * t * F32
    assert ln.param_bytes == 2 * d * F32
    assert ln.output_bytes == t * d * F32


def test_attention_block_saved_bytes_by_hand():
    t, d = 7, 8
    prof = quick(nn.Sequential(TinyAttention(d)), torch.randn(3, t, d), [1, 3])
    (att,) = prof.layers
    for b in (1, 3):
        x = b * t * d * F32  # saved once by all three projections
        qkv = 3 * b * t * d * F32  # q and k for the scores, v for the output
        probs = b * t * t * F32  # softmax result, also the left operand of p @ v
        assert att.saved_bytes[b] == x + qkv + probs


def test_batchnorm_buffers_are_model_memory_not_activations():
    prof = quick(nn.Sequential(nn.BatchNorm1d(6)), torch.randn(4, 6), [2])
    (bn,) = prof.layers
    assert bn.buffer_bytes == (6 + 6) * F32 + 8  # running mean, var, num_batches_tracked
    assert bn.saved_bytes[2] < 2 * 6 * F32 + 64  # the input (plus tiny stats), never the buffers


class _Counting(nn.Module):
    """Replaces its buffer on every forward (not in place), as some models count calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("first", torch.zeros(()))
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("last", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        if self.training:  # a cache: fills a None buffer, registers new ones, moves one
            self.last = x.detach().mean()
            self.register_buffer("seen", torch.ones(()))
            self.register_buffer("scratch", torch.ones(()), persistent=False)
            first = self._buffers.pop("first")
            self.register_buffer("first", first)
        return x * 1.5


def test_profiling_gives_back_the_models_buffers_gradients_and_random_stream():
    """Profiling runs the model in training mode (BatchNorm's statistics move, dropout draws, a
    forward may replace a buffer): afterwards the caller's model holds what it held, in the
    mode it was in, with its gradients, and the random stream is where it was."""
    model = nn.Sequential(
        nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), _Counting(), nn.Linear(6, 2)
    )
    model.eval()
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    calls = model[3].calls
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    quick(model, torch.randn(4, 6), [2, 4])
    drawn = torch.rand(3)
    torch.manual_seed(7)
    torch.randn(4, 6)  # what the call above drew for its sample
    assert torch.equal(drawn, torch.rand(3))
    assert not model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])
    ]
    assert model[3].calls is calls
    assert model[3].last is None and list(model[3]._buffers) == ["first", "calls", "last"]
    assert not model[3]._non_persistent_buffers_set
    assert list(model.state_dict()) == list(before)
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert model[4].weight.grad is None


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad shape")


def test_a_failing_layer_is_reported_even_with_buffers_that_cannot_be_written():
    """Giving the model back must not replace the error being reported (here a buffer made
    under inference mode, which cannot be written outside it)."""
    norm = nn.BatchNorm1d(6)
    with torch.inference_mode():
        norm.register_buffer("frozen", torch.ones(6))
    model = nn.Sequential(nn.Linear(6, 6), norm, _Boom())
    with pytest.raises(InputError, match="bad shape"):
        quick(model, torch.randn(4, 6), [2])
    # and one that profiles: its unchanged inference buffer is left alone
    quick(nn.Sequential(nn.Linear(6, 6), norm), torch.randn(4, 6), [2])


def test_tuple_outputs_cross_layers():
    prof = quick(nn.Sequential(Pair(), Join()), torch.randn(2, 5), [2])
    pair, join = prof.layers
    assert pair.output_shape == [[5], [3]]
    assert pair.output_bytes == (5 + 3) * F32
    assert join.output_shape == [[3]]


def test_profile_json_round_trips(tmp_path):
    prof = quick(mlp(width=16, depth=2), torch.randn(4, 16), [1, 2, 4], overhead=True)
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    assert again.canonical_json() == path.read_text()
    assert again.digest() == prof.digest()
    # on the CPU the runtime's own costs are measured with the layers, and kept
    assert prof.runtime is not None and again.runtime == prof.runtime
    assert 0 <= prof.runtime.action_ms < 50 and 0 <= prof.runtime.step_ms < 500
    assert 0 < prof.runtime.call_ms < 50


def test_a_tied_parameters_frozen_flag_is_written_only_where_one_is_frozen():
    """TiedParameter.frozen came later: a profile none of whose tied parameters is frozen
    writes and digests as before it existed; a frozen one is written, and round-trips."""
    prof = quick(mlp(width=16, depth=2), torch.randn(4, 16), [1, 2])
    data = json.loads(prof.canonical_json())
    data["tied"] = [{"bytes": 64, "layers": [0, 2]}]
    before = Profile.from_json_text(json.dumps(data))
    assert '"frozen"' not in before.canonical_json() and not before.tied[0].frozen
    data["tied"][0]["frozen"] = False  # (the default, spelled out: the same profile)
    assert Profile.from_json_text(json.dumps(data)).digest() == before.digest()
    data["tied"][0]["frozen"] = True
    frozen = Profile.from_json_text(json.dumps(data))
    assert '"frozen": true' in frozen.canonical_json() and frozen.digest() != before.digest()
    assert Profile.from_json_text(frozen.canonical_json()) == frozen
    data["tied"][0]["frozen"] = 1  # (strict: not a number)
    with pytest.raises(InputError):
        Profile.from_json_text(json.dumps(data))


def test_a_profile_in_any_key_order_has_the_digest_and_bytes_made_in_memory(tmp_path):
    """json's sorted keys put size 16 before 2, and pydantic's serializer writes a map in its
    own order: a profile whose maps or optimizers come in any order (from a file, or put in by
    model_copy, which skips the validator) has the digest and canonical bytes of the one made
    in memory, and reads its maps by increasing size."""
    prof = synthetic_profile([1.0, 2.0, 3.0], sizes=[1, 2, 16], loss={"forward": 0.5})
    prof = Profile.from_json_text(
        prof.canonical_json().replace('"optimizer_step": {}', '"optimizer_step": {"sgd": '
        '{"foreach": true, "per_byte": 0.0}, "adam": {"foreach": false, "per_byte": 2.0}}')
    )  # fmt: skip
    data = json.loads(prof.canonical_json())
    assert list(data["layers"][0]["forward_ms"]) == ["1", "2", "16"]
    assert list(data["loss"]["saved_bytes"]) == ["1", "2", "16"]
    assert list(data["optimizer_step"]) == ["adam", "sgd"]
    path = tmp_path / "sorted.json"
    path.write_text(json.dumps(data, sort_keys=True))  # "1", "16", "2"
    assert path.read_text().index('"16"') < path.read_text().index('"2"')
    again = Profile.load(path)
    assert list(again.layers[0].forward_ms) == [1, 2, 16] == list(again.loss.backward_ms)
    assert again.digest() == prof.digest() and again.canonical_json() == prof.canonical_json()
    # put in out of order past the validator: the same digest and bytes all the same
    edited = prof.model_copy(update={
        "layers": [x.model_copy(update={"forward_ms": dict(reversed(x.forward_ms.items()))})
                   for x in prof.layers],
        "optimizer_step": dict(reversed(prof.optimizer_step.items())),
    })  # fmt: skip
    assert list(edited.layers[0].forward_ms) == [16, 2, 1]
    assert edited.digest() == prof.digest() and edited.canonical_json() == prof.canonical_json()
    # another value is another digest
    data["layers"][1]["saved_bytes"]["16"] += 1
    assert Profile.from_json_text(json.dumps(data, sort_keys=True)).digest() != prof.digest()
    # a map missing a size, or with one more, is still refused in any order
    for edit in ("del", "add"):
        bad = json.loads(json.dumps(data))
        if edit == "del":
            del bad["layers"][1]["saved_bytes"]["2"]
        else:
            bad["layers"][1]["saved_bytes"]["4"] = 1
        with pytest.raises(InputError, match="saved_bytes is not given for every batch size"):
            Profile.from_json_text(json.dumps(bad, sort_keys=True))


def test_transformer_profile_has_every_layer_and_size():
    model = transformer(depth=2, seq_len=16, d_model=32)
    prof = quick(model, model.example_input, [1, 2])
    assert [x.type for x in prof.layers] == [
        "TokenEmbedding",
        "Block",
        "Block",
        "LayerNorm",
        "Linear",
    ]
    assert all(x.forward_ms[2].median > 0 for x in prof.layers)
    assert prof.input_dtype == "int64" and prof.input_shape == [16]
    assert prof.layers[-1].output_bytes == 16 * 512 * F32


def test_a_module_that_is_not_sequential_is_captured_as_a_graph():
    prof = quick(TinyAttention(4), torch.randn(1, 2, 4), [1])
    assert prof.captured
    assert [x.name for x in prof.layers] == ["q", "k", "v"]
    # after q: the input (k and v still need it) and q; after k: the input, q and k; after v:
    # the output (the attention itself runs in the model's own forward, joined to v)
    assert [len(x.crossing) for x in prof.layers] == [2, 3, 1]
    assert prof.layers[0].crossing[0] == prof.layers[1].crossing[0] == "x"
    assert [x.output_bytes for x in prof.layers] == [2 * 8 * F32, 3 * 8 * F32, 8 * F32]


def test_rejected_input_names_the_layer():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(InputError, match=r"layer 2 \(Linear\)"):
        quick(model, torch.randn(2, 4), [1])


def test_profiling_the_transformer_twice_gives_the_same_plan(tmp_path, run_cli):
    """Identical blocks are timed together until their median is stable, and share it: the
    plan balances the model, not the noise of one run."""
    plans = []
    for k in range(2):
        prof, plan = tmp_path / f"p{k}.json", tmp_path / f"plan{k}.json"
        r = run_cli("profile", "example:transformer", "--batch-sizes", "4,8", "--max-repeats",
                    "40", "--time-budget", "4", "-o", prof)  # fmt: skip
        assert r.code == 0, r.err
        blocks = [x for x in Profile.load(prof).layers if x.type == "Block"]
        assert len({x.forward_ms[8].median for x in blocks}) == 1  # one figure for all eight
        assert blocks[0].forward_ms[8].samples >= 5 * len(blocks)
        r = run_cli("plan", prof, "--devices", 4, "--memory", "1GiB", "--batch-size", 32,
                    "--schedule", "1f1b", "--microbatches", 4, "--recompute", "never", "-o", plan)  # fmt: skip
        assert r.code == 0, r.err
        plans.append(Plan.load(plan))
    assert [s.layers for s in plans[0].stages] == [s.layers for s in plans[1].stages]


class _AddsInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)


def test_a_layer_that_changes_its_input_in_place_is_named_with_what_to_do():
    """Found by a review: a layer that changes its input in place was refused as "the model
    rejected input ... a leaf Variable that requires grad is being used in an in-place
    operation", which reads as the model's fault on its input. (Layers with an `inplace` flag,
    ReLU(inplace=True), are profiled and run with it off: test_codegen.)"""
    model = nn.Sequential(nn.Linear(16, 16), _AddsInPlace(), nn.Linear(16, 4))
    with pytest.raises(InputError, match=r"layer 1 \(_AddsInPlace\) changes its input in place"):
        quick_profile(model, torch.randn(4, 16), batch_sizes=[2])


class _Halves(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: x.shape[0] // 2]


class _Transposes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class _Flattens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 2)


def test_a_layer_that_changes_the_batch_is_named_but_a_flattened_batch_is_not():
    """Found by a red team: a layer that halved its batch was profiled, planned and measured
    (the loss broadcast over targets of the whole batch, with torch's warning). A pipeline
    splits the batch: the model's output must keep it first, or a whole multiple of it (a
    language model's tokens, flattened for the loss)."""
    model = nn.Sequential(nn.Linear(8, 8), _Halves(), nn.Linear(8, 4))
    with pytest.raises(InputError, match=r"layer 1 \(_Halves\) turns a batch of 2 samples into 1"):
        quick_profile(model, torch.randn(4, 8), batch_sizes=[2, 4], loss_fn="mse")
    # a batch put first again does not count: the layer that broke it last is named
    # (found by a review)
    layers = [nn.Linear(8, 8), _Transposes(), nn.Linear(8, 8), _Transposes(), nn.Linear(8, 8)]
    there_and_back = nn.Sequential(*layers, _Halves(), nn.Linear(8, 4))
    with pytest.raises(InputError, match=r"layer 5 \(_Halves\) turns a batch of 2 samples"):
        quick_profile(there_and_back, torch.randn(4, 5, 8), batch_sizes=[2, 4], loss_fn="mse")
    flat = nn.Sequential(nn.Linear(8, 8), _Flattens(), nn.Linear(2, 2))
    prof = quick_profile(flat, torch.randn(4, 8), batch_sizes=[2, 4], loss_fn="mse")
    assert len(prof.layers) == 3


def test_measuring_w_leaves_no_graph_behind(monkeypatch):
    """The profile wraps each tensor a layer's graph saves to see what its W lets go; a saved
    output's wrapper and its node hold each other through C++, out of the collector's sight.
    Every wrapper is gone once the layer is measured, with and without a W (a ReLU has none:
    its graph is never run), the collector off."""
    import gc
    import weakref

    import profiler.measure as measure

    made: list[weakref.ref] = []
    init = measure._Held.__init__

    def counted(self: measure._Held, tensor: torch.Tensor) -> None:
        init(self, tensor)
        made.append(weakref.ref(self))

    monkeypatch.setattr(measure._Held, "__init__", counted)
    x = torch.randn(4, 8, requires_grad=True)
    was = gc.isenabled()
    gc.disable()
    try:
        for layer in (nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sigmoid()), nn.ReLU()):
            made.clear()
            figures = measure._transient(layer, x, torch.device("cpu"), "both")
            assert made and not any(ref() is not None for ref in made)
            assert figures["w_kept"] == (0 if isinstance(layer, nn.Sequential) else 128)
    finally:
        if was:
            gc.enable()
