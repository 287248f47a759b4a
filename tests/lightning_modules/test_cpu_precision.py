"""The CPU trainer's precision follows the hardware: bf16 autocast only where the CPU has bf16 kernels (emulated bf16
is 7–10× slower per training step on an AVX2-only CPU), an explicit ``trainer.precision`` still wins; where a run
asks for bf16-mixed on such a CPU, its matrix products take float32 BLAS with a bf16 kernel's numbers
(flowlm/ops/bf16_products.py)."""

import pytest
import torch
from conftest import compose_config

from runners.resolvers import cpu_precision


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_cpu_precision_follows_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert cpu_precision() == expected
    cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu"])
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == expected


def test_cpu_precision_without_the_query_is_float32(monkeypatch):
    def missing():
        raise AttributeError("no such op")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cpu_precision() == "32-true"


def test_an_explicit_precision_wins(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", "trainer.precision=bf16-mixed"])
    assert cfg.trainer.precision == "bf16-mixed"


# bf16 products by float32 BLAS (flowlm/ops/bf16_products.py) on a CPU without bf16 kernels


@pytest.fixture(autouse=False)
def torch_bf16():
    """torch's own CPU autocast kernels during the test, though an earlier in-process bf16 run (on a CPU without bf16
    kernels) installed the rule for the process: it is taken out, and put back after."""
    import flowlm.ops.bf16_products as products

    installed = products._installed
    if installed is not None:
        installed._destroy()
        products._installed = None
    yield
    if installed is not None:
        products.install_bf16_products()


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t's values rounded to bf16, held in float32 (exact: bf16 ⊂ float32)."""
    return t.to(torch.bfloat16).float()


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(2, 24, 40, generator=g),
        "b": torch.randn(2, 40, 16, generator=g),
        "w": torch.randn(16, 40, generator=g),
        "bias": torch.randn(16, generator=g),
        "c": torch.randn(2, 24, 16, generator=g),
    }


def _products(x):
    """Each matrix product of PRODUCTS as the DiTs and their backward call it."""
    a, b, w, bias, c = x["a"], x["b"], x["w"], x["bias"], x["c"]
    return {
        "mm": torch.mm(a[0], b[0]),
        "bmm": torch.bmm(a, b),
        "addmm": torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2.0),
        "baddbmm": torch.baddbmm(c, a, b),
        "linear": torch.nn.functional.linear(a, w, bias),
        "matmul": a @ b,
    }


def test_bf16_products_are_a_bf16_kernels_arithmetic(torch_bf16):
    """Under bf16 autocast each product is bf16(float32 product of the bf16-rounded operands): exactly that rule
    (the same float32 BLAS), bf16 out, as torch's own bf16 kernel computes it up to the float32 accumulation's order
    (at most one bf16 rounding step apart, on few elements); outside autocast nothing changes."""
    from flowlm.ops.bf16_products import PRODUCTS, bf16_products_in_float32

    x = _operands()
    r = {k: _bf16(v) for k, v in x.items()}
    rule = {
        "mm": r["a"][0] @ r["b"][0],
        "bmm": r["a"] @ r["b"],
        "addmm": 0.5 * r["c"][0] + 2.0 * (r["a"][0] @ r["b"][0]),
        "baddbmm": r["c"] + r["a"] @ r["b"],
        "linear": r["a"] @ r["w"].T + r["bias"],
        "matmul": r["a"] @ r["b"],
    }
    assert set(rule) == set(PRODUCTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = _products(x)
        with bf16_products_in_float32():
            emulated = _products(x)
    for name in PRODUCTS:
        assert emulated[name].dtype == torch.bfloat16 == native[name].dtype, name
        assert torch.allclose(emulated[name].float(), rule[name], rtol=2**-8, atol=1e-5), name  # one bf16 rounding
        step = native[name].float().abs().clamp_min(1e-3) * 2**-7  # one bf16 ulp (8 significant bits)
        apart = (emulated[name].float() - native[name].float()).abs()
        assert (apart <= step * 1.01).all() and (apart > 0).float().mean() < 0.05, name
    with bf16_products_in_float32():  # no autocast: float32 products, unchanged
        assert torch.equal(torch.mm(x["a"][0], x["b"][0]), x["a"][0] @ x["b"][0])
    exact = {k: torch.tensor([[1.5, -2.0]]) for k in ("p",)}["p"]  # bf16-exact operands: the exact product
    with torch.autocast("cpu", dtype=torch.bfloat16), bf16_products_in_float32():
        assert torch.mm(exact, exact.T).item() == 6.25


def test_bf16_products_equal_the_rule_exactly_where_the_sum_is_exact(torch_bf16):
    """Small integers are bf16-exact and their products and sums are exact in float32: emulated and native agree
    bit for bit. On other values the rule is the float32 product of the bf16-rounded operands, rounded once (not the
    float32 product of the operands themselves)."""
    from flowlm.ops.bf16_products import bf16_products_in_float32

    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(-8, 9, (32, 64), generator=g).float(), torch.randint(-8, 9, (64, 24), generator=g).float()
    u, v = a / 3 + 0.01, b / 7 - 0.003  # not bf16-exact: the operands' rounding shows
    rule = (_bf16(u) @ _bf16(v)).to(torch.bfloat16)  # outside autocast: float32 products
    unrounded = (u @ v).to(torch.bfloat16)
    assert not torch.equal(rule, unrounded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = a @ b
        with bf16_products_in_float32():
            assert torch.equal(a @ b, native)
            assert torch.equal(u @ v, rule)


def test_bf16_products_keep_autocasts_rule_elsewhere(torch_bf16):
    """Another autocast dtype (float16) or a float64 operand: torch's own rule, unchanged; after the block torch's
    own kernels again."""
    from flowlm.ops.bf16_products import bf16_products_in_float32

    x = _operands(2)
    with torch.autocast("cpu", dtype=torch.float16):
        native = _products(x)
        with bf16_products_in_float32():
            emulated = _products(x)
    for name in native:
        assert emulated[name].dtype == native[name].dtype == torch.float16 and torch.equal(emulated[name], native[name])
    d = x["a"][0].double()
    with torch.autocast("cpu", dtype=torch.bfloat16), bf16_products_in_float32():
        assert torch.mm(d, d.T).dtype == torch.float64


def test_bf16_gradients_follow_the_same_rule(torch_bf16):
    """The backward's products go through the same rule (autograd records the rounded operands): the gradients of
    a bf16 linear equal the float32 rule's, rounded as a bf16 kernel rounds them."""
    from flowlm.ops.bf16_products import bf16_products_in_float32

    x = _operands(3)
    w = x["w"].clone().requires_grad_()
    a = x["a"].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), bf16_products_in_float32():
        out = torch.nn.functional.linear(a, w)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out.backward(g)
    go = g.float()
    assert torch.allclose(w.grad, _bf16(go.reshape(-1, 16).T @ _bf16(a.detach()).reshape(-1, 40)), rtol=2**-8)
    assert torch.allclose(a.grad, _bf16(go @ _bf16(w.detach())), rtol=2**-8, atol=1e-6)


def test_a_bf16_run_on_a_cpu_without_bf16_kernels_takes_float32_products(monkeypatch):
    """runners.common.cpu_choices: on the CPU under bf16-mixed without bf16 kernels, installed (once); with the
    kernels, in float32, or on a GPU trainer, not."""
    import flowlm.ops.bf16_products as products
    from runners.common import cpu_choices

    installed = []
    monkeypatch.setattr(products, "install_bf16_products", lambda: installed.append(1) or True)
    train = ["experiment=sudoku_mdm_easy", "scale=cpu"]
    for native, precision, expected in [
        (False, "bf16-mixed", True),
        (True, "bf16-mixed", False),
        (False, "32-true", False),
    ]:
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda native=native: native)
        cfg = compose_config(overrides=[*train, f"trainer.precision={precision}"])
        assert cpu_choices(cfg) is expected, (native, precision)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_choices(compose_config(overrides=[*train, "trainer=gpu", "trainer.precision=bf16-mixed"])) is False
    assert installed == [1]


def test_bf16_products_run_at_float32_speed_where_the_cpu_has_no_bf16_kernels(torch_bf16):
    """The point of the rule: a bf16 autocast matmul here costs about a float32 one, not torch's bf16 loop (1.0
    against 95.6 GFLOP/s measured on an AVX2 EPYC). Measured side by side; where the CPU has bf16 kernels the rule
    is not used (cpu_choices) and nothing is asserted."""
    import time

    from flowlm.ops.bf16_products import bf16_products_in_float32, native_bf16_kernels

    if native_bf16_kernels():
        pytest.skip("this CPU has bf16 kernels: runs use them")
    a = torch.randn(256, 256)

    def seconds(reps: int = 3) -> float:
        a @ a
        start = time.perf_counter()
        for _ in range(reps):
            a @ a
        return (time.perf_counter() - start) / reps

    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = seconds()
        with bf16_products_in_float32():
            emulated = seconds()
    fp32 = seconds()
    print(f"256² matmul: bf16 loop {native * 1e3:.2f} ms, rule {emulated * 1e3:.2f} ms, float32 {fp32 * 1e3:.2f} ms")
    assert emulated * 3 < native, (emulated, native)


@pytest.mark.parametrize("runner", ["train", "evaluate"])
def test_flowlm_train_and_eval_take_float32_products_before_anything_else(monkeypatch, tmp_path, runner):
    """The runners' own call: a bf16-mixed run on a CPU without bf16 kernels that is refused right after (a bad run
    name; a missing checkpoint) has already installed the rule (the spy stands in: installed for good it would
    change the bf16 numbers of the tests after this one on a CPU with the kernels)."""
    import flowlm.ops.bf16_products as products

    installed = []
    monkeypatch.setattr(products, "install_bf16_products", lambda: installed.append(1) or True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    common = [f"paths.root={tmp_path}", "logger=none", "trainer=cpu", "trainer.precision=bf16-mixed"]
    if runner == "train":
        from runners.train import train

        cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", "run_name=../out", *common])
        with pytest.raises(ValueError, match="run_name"):
            train(cfg)
    else:
        from runners.evaluate import evaluate

        cfg = compose_config("eval", [f"ckpt_path={tmp_path / 'missing.ckpt'}", *common])
        with pytest.raises(FileNotFoundError):
            evaluate(cfg)
    assert installed == [1]
