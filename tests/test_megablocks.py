"""`model.backend: megablocks` on CPU: MegaBlocks' real dMoE (0.10.0) run by tests/megablocks_shim.py.

The shim replaces MegaBlocks' CUDA and Triton kernels (and grouped_gemm) by torch ops; everything else
is MegaBlocks' own code, called through moeflow's wrapper (moe/megablocks_backend.py). `make setup`
installs megablocks and stanford-stk without their dependencies, so these tests always run.
Covered: one state dict for both backends (model level, strict, both directions, safetensors), float64
parity with the reference layer, the import and config errors, the bf16 rule of grouped_gemm's CUDA op
(simulated), and a training run that is killed, resumed and evaluated, against the torch backend's
(and a torch-backend checkpoint resumed with megablocks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import megablocks_shim as shim
import numpy as np
import pytest
import torch

shim.install()  # before anything imports megablocks (process-wide: it only adds modules)

from helpers import write_config, write_training_mix  # noqa: E402
from moeflow import configs  # noqa: E402
from moeflow.configs import EvalConfig, ModelConfig, TrainConfig  # noqa: E402
from moeflow.moe import evaluate, megablocks_backend, train  # noqa: E402
from moeflow.moe.backend import build_moe  # noqa: E402
from moeflow.moe.layer import MoE  # noqa: E402
from moeflow.moe.losses import router_z_loss  # noqa: E402
from moeflow.moe.model import Transformer  # noqa: E402
from moeflow.tokenize import mix  # noqa: E402

TESTS = Path(__file__).resolve().parent
T, D, E, FF = 37, 16, 8, 32  # E * FF >= 128: dMoE's constructor takes log2(E * FF // 128)
TOL = 1e-12  # float64 parity; measured: outputs 4.4e-16, input gradients 8.9e-16, the rest 0
# Loss curves of the torch and megablocks backends in fp32 (same initial weights, same data) differ by
# summation order only. Measured over 12 steps: cross-entropy at most 2.0e-6 relative (one unit in the
# fifth decimal metrics.jsonl keeps; 0 in some runs), load-balancing and z-loss 0.
CURVE_RTOL = 1e-4


def _cfg(top_k: int = 2, **kw) -> ModelConfig:
    return ModelConfig(d_model=D, n_heads=2, num_experts=E, top_k=top_k, expert_hidden=FF, **kw)


def _mb(cfg: ModelConfig) -> torch.nn.Module:
    with shim.fake_cuda():  # the wrapper insists on CUDA; the shim's kernels run on CPU
        return build_moe(cfg.model_copy(update={"backend": "megablocks"}))


@pytest.fixture
def cpu_only(monkeypatch):
    """A machine without CUDA, even where there is one (train.device auto, evaluation)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cpu_megablocks(cpu_only, monkeypatch):
    """Every MegaBlocksMoE built in the test (train.run, evaluate.load_model) is built under fake_cuda."""
    real = megablocks_backend.MegaBlocksMoE

    def build(cfg):
        with shim.fake_cuda():
            return real(cfg)

    monkeypatch.setattr(megablocks_backend, "MegaBlocksMoE", build)


# ---- one state dict --------------------------------------------------------------------------------------
def test_transformer_state_dict_is_the_torch_backends_and_loads_strictly_both_ways(cpu_megablocks, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = _cfg(n_layers=3, dense_layers=1, shared_expert_hidden=16)
    torch.manual_seed(0)
    ref = Transformer(cfg, vocab_size=32, max_seq_len=16).double()
    torch.manual_seed(0)
    mb_cfg = cfg.model_copy(update={"backend": "megablocks"})
    mb = Transformer(mb_cfg, vocab_size=32, max_seq_len=16).double()
    sd_ref, sd_mb = ref.state_dict(), mb.state_dict()
    assert [(k, v.shape) for k, v in sd_mb.items()] == [(k, v.shape) for k, v in sd_ref.items()]
    # the same order too: checkpoints keep the optimizer state by parameter index
    assert [n for n, _ in mb.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert not any(".dmoe." in k for k in sd_mb)
    # the same seed gives the same initial weights with either backend
    assert all(torch.equal(sd_mb[k], v) for k, v in sd_ref.items())
    # the dMoE's own parameters are the registered ones: no tensor reachable twice, nothing left out
    assert len({id(p) for p in mb.parameters()}) == len(list(mb.parameters())) == len(list(ref.parameters()))
    save_file({k: v.contiguous() for k, v in sd_mb.items()}, str(tmp_path / "mb.safetensors"))  # no sharing
    tokens = torch.randint(0, 32, (2, 16))
    for src, dst in ((ref, mb), (mb, ref)):
        torch.manual_seed(1)
        other = Transformer(dst.cfg, vocab_size=32, max_seq_len=16).double()
        with torch.no_grad():
            for p in src.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # a trained state, different from `other`'s
        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "w.safetensors"))
        other.load_state_dict(load_file(str(tmp_path / "w.safetensors")), strict=True)
        torch.testing.assert_close(other(tokens)[0], src(tokens)[0], rtol=0, atol=TOL)


# ---- float64 parity --------------------------------------------------------------------------------------
def _grads(loss, x, module):
    names, params = zip(*module.named_parameters())
    gs = torch.autograd.grad(loss, (x, *params), retain_graph=True, allow_unused=True)
    return {n: torch.zeros(()) if g is None else g for n, g in zip(("x", *names), gs)}


def compare(ref, mb, seed=0) -> dict[str, float]:
    """Max abs differences: output, losses, counts, and each gradient of each of the three."""
    torch.manual_seed(seed)
    x = torch.randn(T, D, dtype=torch.float64)
    g = torch.randn(T, D, dtype=torch.float64)
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    (yr, ar), (ym, am) = ref(xr), mb(xm)
    d = {"out": (yr - ym).abs().max().item(),
         "tokens_per_expert": (ar["tokens_per_expert"] - am["tokens_per_expert"]).abs().max().item()}
    for what in ("load_balancing_loss", "router_z_loss"):
        assert ar[what].dtype == am[what].dtype == torch.float64
        d[what] = (ar[what] - am[what]).abs().item()
    losses = {"out": ((yr * g).sum(), (ym * g).sum()),
              "lbl": (ar["load_balancing_loss"], am["load_balancing_loss"]),
              "zloss": (ar["router_z_loss"], am["router_z_loss"])}
    for what, (a, b) in losses.items():
        ga, gb = _grads(a, xr, ref), _grads(b, xm, mb)
        assert ga.keys() == gb.keys()
        for k in ga:
            d[f"grad[{what}].{k}"] = (ga[k] - gb[k]).abs().max().item()
    return d


def _pair(top_k: int, **kw):
    cfg = _cfg(top_k, **kw)
    torch.manual_seed(top_k)
    ref = MoE(cfg).double().train()
    torch.manual_seed(top_k)
    mb = _mb(cfg).double().train()
    mb.load_state_dict(ref.state_dict(), strict=True)
    return ref, mb


@pytest.mark.parametrize("glu", [True, False], ids=["glu", "mlp"])
@pytest.mark.parametrize("shared", [0, 16], ids=["routed", "shared"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_float64_parity_with_the_reference_layer(top_k, shared, glu):
    ref, mb = _pair(top_k, shared_expert_hidden=shared, glu=glu)
    d = compare(ref, mb)
    assert d["tokens_per_expert"] == 0
    bad = {k: v for k, v in d.items() if v > TOL}
    assert not bad, bad


def test_top1_convention_is_megablocks_in_both_backends():
    """normalize_expert_weights: the single weight is p / ||p||_1 = 1.0 in both (the router then learns from
    the auxiliary losses only); without it, the weight is p_max, again in both."""
    x = torch.randn(T, D, dtype=torch.float64)
    for normalize in (True, False):
        ref, mb = _pair(1, normalize_expert_weights=normalize)
        r = ref.router(x)
        expected = torch.ones_like(r.weights_TK) if normalize else r.probs_TE.max(-1, keepdim=True).values
        torch.testing.assert_close(r.weights_TK, expected, rtol=0, atol=0)
        assert max(compare(ref, mb).values()) <= TOL


def test_router_z_loss_is_computed_in_the_logits_dtype():
    """MegaBlocks' default (moe_zloss_in_fp32=False), in the reference too."""
    logits = torch.randn(T, E) * 4
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        z = router_z_loss(logits_TE=logits.to(dtype))
        assert z.dtype == dtype
        assert z == torch.logsumexp(logits.to(dtype), dim=-1).square().mean()


# ---- errors ----------------------------------------------------------------------------------------------
def test_config_refuses_experts_too_narrow_for_dmoe(tmp_path):
    """dMoE's constructor takes log2(expert_hidden * num_experts // 128): OverflowError below 128."""
    with pytest.raises(ValueError, match=r"expert_hidden=8 \* num_experts=8 = 64"):
        configs.load(write_config(tmp_path / "c.yaml", model={"backend": "megablocks", "expert_hidden": 8,
                                                              "num_experts": 8}))
    ModelConfig(n_heads=2, num_experts=8, expert_hidden=16, backend="megablocks")  # 128: fine
    ModelConfig(n_heads=2, num_experts=8, expert_hidden=8)  # the torch backend has no such limit


_BUILD = """
import sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import megablocks_shim as shim
{setup}
from moeflow.configs import ModelConfig
from moeflow.moe.backend import build_moe
try:
    with shim.fake_cuda():
        build_moe(ModelConfig(d_model=16, n_heads=2, num_experts=8, expert_hidden=32, backend="megablocks"))
except RuntimeError as e:
    print("RuntimeError:", e)
"""


@pytest.mark.parametrize("missing, setup", [
    pytest.param("megablocks", "sys.modules['megablocks'] = None", id="megablocks"),
    # as after a build that skipped the CUDA extension (triton: a stand-in where it is not installed)
    pytest.param("megablocks_ops", "shim.register_triton_stub(); sys.modules['megablocks_ops'] = None",
                 id="megablocks_ops"),
    pytest.param("grouped_gemm", "sys.modules['grouped_gemm'] = None; shim.install(grouped_gemm=False)",
                 id="grouped_gemm"),
])
def test_every_missing_piece_is_one_runtime_error_naming_the_install_command(missing, setup):
    """A fresh interpreter: no megablocks / its CUDA extension / grouped_gemm (the AssertionError inside
    MegaBlocks' Arguments)."""
    code = _BUILD.format(tests=str(TESTS), setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("RuntimeError: model.backend=megablocks"), out.stdout + out.stderr
    assert missing in out.stdout
    assert "pip install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1 " \
           "grouped_gemm==0.3.0" in out.stdout


def test_without_cuda_the_backend_says_so(cpu_only):
    with pytest.raises(RuntimeError, match="needs CUDA; use backend: torch"):
        build_moe(_cfg(backend="megablocks"))


# ---- grouped_gemm's CUDA op takes bf16 only --------------------------------------------------------------
@pytest.fixture
def bf16_only_gemm(monkeypatch):
    """The shim's gmm refuses non-bf16 operands as grouped_gemm's CUDA op does, and the wrapper treats the
    CPU as it treats CUDA."""
    monkeypatch.setattr(shim, "GMM_BF16_ONLY", True)
    monkeypatch.setattr(megablocks_backend, "BF16_ONLY_DEVICES", ("cuda", "cpu"))


@pytest.fixture
def cuda_autocast_flags():
    """Turn on CUDA autocast's flags (bf16) on a CPU-only build: MegaBlocks' memory-optimized MLP
    (`custom_fwd(device_type='cuda')`) reads them and casts, exactly as under torch.autocast('cuda')."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    yield
    torch.set_autocast_enabled("cuda", False)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_fp32_weights_train_under_bf16_autocast_and_fp32_training_is_refused(bf16_only_gemm,
                                                                              cuda_autocast_flags):
    mb = _mb(_cfg(2, shared_expert_hidden=16)).train()
    x = torch.randn(T, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="train.precision: bf16"):
        mb(x)  # fp32 training
    with torch.autocast("cpu", dtype=torch.bfloat16):  # on CUDA: torch.autocast("cuda"), precision bf16
        y, aux = mb(x)
    assert y.dtype == torch.bfloat16
    (y.float().square().mean() + aux["load_balancing_loss"] + aux["router_z_loss"]).backward()
    assert {p.dtype for p in mb.parameters()} == {p.grad.dtype for p in mb.parameters()} == {torch.float32}
    assert all(p.grad.abs().sum() > 0 for p in mb.parameters())
    mb.eval()
    with torch.no_grad():  # evaluation of fp32 weights: the wrapper autocasts the dMoE itself
        y, _ = mb(x)
    assert y.dtype == torch.float32
    out, _ = mb.to(torch.bfloat16).train()(x.detach().bfloat16().requires_grad_())  # a bf16 module
    assert out.dtype == torch.bfloat16


def test_without_the_autocast_cast_the_bf16_only_gemm_fails(monkeypatch):
    """What the memory-optimized MLP's cast prevents: the non-optimized grouped MLP hands gmm fp32 weights
    (MegaBlocks casts x to bf16, not the weights), which grouped_gemm's CUDA op refuses."""
    monkeypatch.setattr(shim, "GMM_BF16_ONLY", True)
    mb = _mb(_cfg(2))
    monkeypatch.setattr(mb.dmoe.experts.args, "memory_optimized_mlp", False)
    with pytest.raises(RuntimeError, match="bfloat16 only"), torch.autocast("cpu", dtype=torch.bfloat16):
        mb(torch.randn(T, D, requires_grad=True))


# ---- a training run: killed, resumed, evaluated, against the torch backend -------------------------------
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, expert_hidden=32)  # 4*32=128


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = write_training_mix(tmp_path_factory.mktemp("data"))
    rng = np.random.default_rng(5)
    rows = [(np.arange(33) * rng.integers(1, 7) + rng.integers(0, 50)) % 300 for _ in range(16)]
    mix.write_rows(root / "heldout.arrow", rows, [[] for _ in rows], 300, domains=["a"] * 8 + ["b"] * 8)
    return root


def _train(data, out, model, **kw):
    cfg = TrainConfig(steps=12, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2, checkpoint_every=4,
                      device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    return train.run(model, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=out, **kw)


def _curve(folder, key="ce"):
    return [r[key] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]


def test_training_killed_resumed_and_evaluated_tracks_the_torch_backend(cpu_megablocks, data, tmp_path):
    mb_model = MODEL.model_copy(update={"backend": "megablocks"})
    torch_run = _train(data, tmp_path / "torch", MODEL)
    whole = _train(data, tmp_path / "mb-whole", mb_model)
    work = tmp_path / "work"
    with pytest.raises(train.StopTraining):
        _train(data, tmp_path / "attempt1", mb_model, work=work, stop_after=10)  # last checkpoint: step 8
    resumed = _train(data, tmp_path / "attempt2", mb_model, work=work)
    assert resumed["resumed_from_step"] == 8
    assert _curve(tmp_path / "attempt2") == _curve(tmp_path / "mb-whole")  # the resume is exact
    assert resumed["final_loss"] == whole["final_loss"]
    for key in ("ce", "load_balancing_loss", "router_z_loss"):
        np.testing.assert_allclose(_curve(tmp_path / "attempt2", key), _curve(tmp_path / "torch", key),
                                   rtol=CURVE_RTOL)
    ce = _curve(tmp_path / "attempt2")
    assert ce[-1] < ce[0] and abs(resumed["final_loss"] - torch_run["final_loss"]) <= CURVE_RTOL * ce[-1]
    model = evaluate.load_model(tmp_path / "attempt2")  # strict load of the saved weights into megablocks
    assert type(model.blocks[0].moe).__name__ == "MegaBlocksMoE"
    results = {}
    for name in ("torch", "attempt2"):
        (tmp_path / f"eval-{name}").mkdir()
        results[name] = evaluate.run(EvalConfig(), train_dir=tmp_path / name, mix_dir=data,
                                     out=tmp_path / f"eval-{name}")["heldout"]
    assert results["torch"].keys() == results["attempt2"].keys() == {"a", "b"}
    for domain, r in results["torch"].items():
        assert results["attempt2"][domain]["loss"] == pytest.approx(r["loss"], rel=CURVE_RTOL, abs=1e-4)
    # a torch-backend checkpoint resumes with the megablocks backend (model and optimizer state)
    with pytest.raises(train.StopTraining):
        _train(data, tmp_path / "torch1", MODEL, work=tmp_path / "work2", stop_after=10)
    _train(data, tmp_path / "torch2-mb", mb_model, work=tmp_path / "work2")
    np.testing.assert_allclose(_curve(tmp_path / "torch2-mb"), _curve(tmp_path / "torch"), rtol=CURVE_RTOL)


def test_the_prefect_train_stage_trains_and_evaluates_with_megablocks(cpu_megablocks, smoke_run, tmp_path,
                                                                      monkeypatch):
    """The smoke preset's train and evaluate stages with `backend: megablocks`, on the cold run's data:
    killed after its step-20 checkpoint, rerun (resuming there), evaluated; the same curve as its
    torch-backend training, and the backend's versions in the key."""
    from moeflow.flows.pretrain import pretrain

    path, first = smoke_run
    base = configs.load(path)
    mb = write_config(tmp_path / "mb.yaml", base=str(path),
                      model={**base.model.model_dump(mode="json"), "backend": "megablocks"},
                      train={**base.train.model_dump(mode="json"), "checkpoint_every": 10})
    real = train.run
    monkeypatch.setattr(train, "run", lambda *a, **kw: real(*a, stop_after=25, **kw))
    with pytest.raises(train.StopTraining, match="stopped before step 26"):
        pretrain(config=str(mb), until="evaluate")
    monkeypatch.setattr(train, "run", real)
    out = pretrain(config=str(mb), until="evaluate")
    assert out["stages"]["mix"]["hash"] == first["stages"]["mix"]["hash"]
    assert not out["stages"]["train"]["reused"]
    runs = [Path(s["stages"]["train"]["artifact"]) for s in (first, out)]
    np.testing.assert_allclose(_curve(runs[1]), _curve(runs[0]), rtol=CURVE_RTOL)
    lineage = json.loads((runs[1] / "lineage.json").read_text())
    assert lineage["stats"]["resumed_from_step"] == 20
    assert lineage["config"]["model"]["backend"] == "megablocks"
    assert lineage["key"]["libraries"]["megablocks"] == "0.10.0"
    evals = [json.loads((Path(s["stages"]["evaluate"]["artifact"]) / "eval.json").read_text())
             for s in (first, out)]
    for domain, r in evals[0].items():
        assert evals[1][domain]["loss"] == pytest.approx(r["loss"], rel=CURVE_RTOL, abs=1e-4)
