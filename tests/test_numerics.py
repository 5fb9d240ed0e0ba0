"""Numerics of the model and its training measurements: expert precision, MFU, initialisation, host syncs,
evaluation without capacity, document masking (issue 41)."""

import json

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from helpers import write_training_mix
from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe import launch, metrics, train
from moeflow.moe.experts import matmul_dtypes
from moeflow.moe.model import Transformer, lm_loss

MOE = ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, expert_hidden=32)


@pytest.mark.parametrize("width", [32, 6])  # 6: the loop path (grouped_mm refuses the stride)
def test_experts_compute_in_bf16_under_bf16_autocast(width):
    torch.manual_seed(0)
    model = Transformer(MOE.model_copy(update={"d_model": width, "n_heads": 1}), vocab_size=50, max_seq_len=16)
    tokens = torch.randint(0, 50, (2, 17))
    with matmul_dtypes(model) as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _, _ = lm_loss(model, tokens)
    assert seen == {"bfloat16"}
    ce.backward()  # float32 master weights still get float32 gradients
    assert model.blocks[0].moe.experts.mlp.w2.grad.dtype == torch.float32
    with matmul_dtypes(model) as seen:
        lm_loss(model, tokens)
    assert seen == {"float32"}  # and without autocast, float32 as before


def _residual_rms(cfg: ModelConfig) -> tuple[float, float]:
    """At init, on random tokens: the RMS of the residual stream after the last block, and of what the
    blocks added to the embedding."""
    torch.manual_seed(0)
    model = Transformer(cfg, vocab_size=256, max_seq_len=64)
    with torch.no_grad():
        x = embedded = model.embed(torch.randint(0, 256, (4, 64)))
        for block in model.blocks:
            x, _ = block(x, model.rope_cos, model.rope_sin)
    return float(x.square().mean().sqrt()), float((x - embedded).square().mean().sqrt())


def test_residual_stream_rms_at_init_does_not_grow_with_depth_in_dense_or_moe_models():
    depths = (2, 8, 32)
    for dense in (False, True):
        cfgs = [MOE.model_copy(update={"d_model": 64, "n_layers": n, "dense_layers": n if dense else 0})
                for n in depths]
        stream, added = zip(*map(_residual_rms, cfgs))
        # the embedding's 0.02 dominates; the 2 * n_layers residual writes, each 1/sqrt(2 * n_layers)
        # smaller, add up to the same few thousandths whatever the depth (unscaled they grow as sqrt(depth))
        assert stream[0] == pytest.approx(0.02, rel=0.1), stream
        assert max(stream) / min(stream) < 1.1, (dense, stream)
        assert max(added) / min(added) < 1.5, (dense, added)
        assert max(added) < 0.5 * stream[0], (dense, added)


@pytest.fixture(scope="module")
def mix_dir(tmp_path_factory):
    return write_training_mix(tmp_path_factory.mktemp("mix"))


def test_mfu_is_per_device_one_rank_or_two(mix_dir, tmp_path):
    """A step's model FLOPs over its time, divided among the ranks that computed it, over one device's peak:
    two ranks that each take as long as one would report the same MFU, not twice it."""
    peak = 1e-4  # TFLOP/s: a tiny model on a CPU still shows several significant digits
    cfg = TrainConfig(steps=2, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=1, checkpoint_every=2,
                      peak_tflops=peak)
    kw = {"seed": 7, "mix_dir": mix_dir, "tokenizer_dir": mix_dir}
    one = train.run(MOE, cfg, out=tmp_path / "one", **kw)
    vocab = one["vocab_size"]
    two = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"nproc_per_node": 2})})
    launch.torchrun(MOE, two, out=tmp_path / "two", work=tmp_path / "two" / "work", **kw)
    model = Transformer(MOE, vocab_size=vocab, max_seq_len=32)
    for ranks in (1, 2):
        lines = (tmp_path / ("one", "two")[ranks - 1] / "metrics.jsonl").read_text().splitlines()
        for r in map(json.loads, lines):
            seconds = r["ranks"][0]["step_s"] if ranks > 1 else cfg.batch_size * r["seq_len"] / r["tokens_per_s"]
            flops = model.flops_per_token(r["seq_len"]) * cfg.batch_size * r["seq_len"]
            per_device = flops / seconds / ranks / 1e12
            assert r["tflops"] == pytest.approx(per_device, rel=0.02, abs=2e-5), (ranks, r)
            assert r["mfu"] == pytest.approx(per_device / peak, rel=0.02), (ranks, r)
    steps = [json.loads(line)["mfu"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert one["mfu"] == round(float(np.median(steps)), 5)  # the median step's, as the TFLOP/s beside it


def test_the_tied_embedding_is_not_decayed_unless_asked():
    """With zero gradients an AdamW step moves a parameter by its weight decay alone."""
    from moeflow.moe.optim import adamw

    for asked in (False, True):
        torch.manual_seed(0)
        model = Transformer(MOE, vocab_size=50, max_seq_len=16)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = TrainConfig(lr=0.1, weight_decay=0.5, embedding_weight_decay=asked)
        opt = adamw(model, cfg)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        shrunk = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
        assert shrunk == (matrices if asked else matrices - {"embed.weight"}), asked
        torch.testing.assert_close(model.blocks[0].attn.qkv.weight, before["blocks.0.attn.qkv.weight"] * 0.95)



def test_the_head_starts_at_the_training_mix_unigram_distribution(mix_dir, tmp_path):
    """`unigram_head_bias`: the head's bias starts at the log frequency of each token in the training mix, so the
    first step's cross-entropy is near the mix's unigram entropy, well under a run without it (near ln V);
    evaluation loads the bias with the model, and a model saved before the option existed loads without one."""
    from moeflow.moe import evaluate
    from moeflow.moe.data import Sequences

    cfg = TrainConfig(steps=1, batch_size=8, seq_len=32, lr=1e-9, warmup_steps=1, checkpoint_every=1)
    first = {}
    for on in (True, False):
        model_cfg = MOE.model_copy(update={"unigram_head_bias": on})
        out = tmp_path / str(on)
        vocab = train.run(model_cfg, cfg, seed=7, mix_dir=mix_dir, tokenizer_dir=mix_dir, out=out)["vocab_size"]
        first[on] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["ce"]
    counts = Sequences(mix_dir / "train.arrow").token_counts(vocab).astype(float) + 1
    p = counts / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    assert first[False] == pytest.approx(np.log(vocab), rel=0.02)
    # one batch's cross-entropy under the unigram distribution is near the whole mix's entropy, not equal
    assert first[True] == pytest.approx(entropy, abs=0.1), (first, entropy)
    assert first[True] < first[False] - (np.log(vocab) - entropy) / 2, (first, entropy)
    loaded = evaluate.load_model(tmp_path / "True")
    torch.testing.assert_close(loaded.head_bias.softmax(-1).double(), torch.from_numpy(p), rtol=1e-3, atol=1e-6)
    meta_path = tmp_path / "False" / "model_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["unigram_head_bias"]
    meta_path.write_text(json.dumps(meta))
    assert evaluate.load_model(tmp_path / "False").head_bias is None

class _HostSyncs(TorchFunctionMode):
    """Counts the calls that read a tensor's value back to the host (on a GPU each waits for its queue)."""

    READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def _syncs(mix_dir, tmp_path, n_layers: int) -> tuple[int, int]:
    """Host reads in one micro-batch's forward and backward, and in clipping (with the per-group norms)."""
    trainer = train.Trainer(MOE.model_copy(update={"n_layers": n_layers}), TrainConfig(batch_size=4, steps=1),
                            seed=0, mix_dir=mix_dir, tokenizer_dir=mix_dir, out=tmp_path / str(n_layers),
                            work=None, ladder_dir=None, band_tolerance=0.0)
    totals = train._Totals()
    with _HostSyncs() as forward:
        trainer.forward_backward(trainer.data.rows(0, 4), totals)
    with _HostSyncs() as clip:
        trainer.clip(totals)
    return forward.count, clip.count


def test_host_syncs_per_step_do_not_grow_with_layers_or_parameters(mix_dir, tmp_path):
    one, four = _syncs(mix_dir, tmp_path, 1), _syncs(mix_dir, tmp_path, 4)
    assert one == four, (one, four)  # not one per MoE layer, nor one per parameter
    assert one[0] <= 1 and one[1] <= 2, one


def test_evaluation_is_dropless_whatever_the_capacity_factor():
    """In eval mode a token's output does not depend on the batch it is in; in training, capacity drops."""
    torch.manual_seed(0)
    cfg = MOE.model_copy(update={"capacity_factor": 0.5})
    model = Transformer(cfg, vocab_size=50, max_seq_len=16)
    a, b = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (6, 16))
    model.eval()
    with torch.no_grad():
        alone, auxes = model(a)
        together, _ = model(torch.cat([a, b]))
    torch.testing.assert_close(together[:2], alone)
    assert all(int(aux["dropped"]) == 0 for aux in auxes)
    model.train()
    assert sum(int(aux["dropped"]) for aux in model(a)[1]) > 0  # the comparison variant still drops in training


def test_document_mask_computes_each_packed_document_as_if_alone():
    torch.manual_seed(0)
    eos = 0
    docs = [torch.randint(1, 50, (n,)) for n in (5, 7, 4)]
    # a packed row: each document followed by EOS; under the mask each EOS opens the next document
    row = torch.cat([docs[0], torch.tensor([eos]), docs[1], torch.tensor([eos]), docs[2]])[None]
    alone = [docs[0][None], torch.cat([torch.tensor([eos]), docs[1]])[None],
             torch.cat([torch.tensor([eos]), docs[2]])[None]]
    spans = [(0, 5), (5, 13), (13, 18)]
    for masked in (True, False):
        torch.manual_seed(0)
        model = Transformer(MOE, vocab_size=50, max_seq_len=32, document_eos=eos if masked else None).eval()
        with torch.no_grad():
            packed = model(row)[0][0]
            same = [torch.allclose(packed[a:b], model(doc)[0][0], atol=1e-5) for doc, (a, b) in zip(alone, spans)]
        # the first document is alone either way; the later ones see the earlier ones unless masked
        assert same == [True, masked, masked], (masked, same)
    # rotary positions restart at each document's EOS (RoPE is relative, so the outputs above cannot show it)
    model = Transformer(MOE, vocab_size=50, max_seq_len=32, document_eos=eos)
    cos = model.attention_inputs(row)[0][0, 0]
    positions = [0, 1, 2, 3, 4] + list(range(8)) + list(range(5))
    torch.testing.assert_close(cos, model.rope_cos[positions])


def test_a_run_trained_with_document_mask_is_evaluated_with_it(mix_dir, tmp_path):
    from moeflow.moe.evaluate import load_model
    from moeflow.tokenize.tokenizer import EOS
    from moeflow.tokenize.tokenizer import load as load_tokenizer

    eos = load_tokenizer(mix_dir).token_to_id(EOS)
    cfg = TrainConfig(steps=2, batch_size=4, seq_len=32, warmup_steps=1, checkpoint_every=2)
    kw = {"seed": 7, "mix_dir": mix_dir, "tokenizer_dir": mix_dir}
    train.run(MOE, cfg.model_copy(update={"document_mask": True}), out=tmp_path / "masked", **kw)
    train.run(MOE, cfg, out=tmp_path / "plain", **kw)
    assert load_model(tmp_path / "masked").document_eos == eos
    assert load_model(tmp_path / "plain").document_eos is None
    assert "document_eos" not in json.loads((tmp_path / "plain" / "model_config.json").read_text())


def test_an_untied_head_is_its_own_matrix_in_training_scoring_and_flops():
    """`tie_embeddings: false` gives the LM head its own matrix: logits and evaluation's scoring use it, it is
    decayed as a matrix, and the FLOPs estimate counts the head's matmul once (as the tied head's)."""
    from moeflow.moe.evaluate import _hidden, loglikelihoods
    from moeflow.moe.optim import decays

    torch.manual_seed(0)
    tied = Transformer(MOE, vocab_size=50, max_seq_len=16)
    torch.manual_seed(0)
    untied = Transformer(MOE.model_copy(update={"tie_embeddings": False}), vocab_size=50, max_seq_len=16)
    assert untied.head.weight.shape == (50, MOE.d_model)
    assert untied.head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # the same draws for every parameter the two share: the head is drawn last
    torch.testing.assert_close(untied.embed.weight, tied.embed.weight)
    tokens = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        logits, _ = untied(tokens)
        torch.testing.assert_close(logits, _hidden(untied, tokens) @ untied.head.weight.T)
        assert not torch.allclose(logits, tied(tokens)[0])
        lp = torch.log_softmax(logits[0].double(), -1)
    ctx, cont = tokens[0, :5].tolist(), tokens[0, 5:].tolist()
    (ll, _), = loglikelihoods(untied, [(ctx, cont)], window=16, dev=torch.device("cpu"))
    assert ll == pytest.approx(sum(lp[4 + i, t].item() for i, t in enumerate(cont)), rel=1e-5)
    assert decays("head.weight", untied.head.weight, TrainConfig())
    assert untied.flops_per_token(16) == tied.flops_per_token(16)
    assert untied.num_params()["active"] == tied.num_params()["active"] + 50 * MOE.d_model



def test_a_head_over_token_classes_predicts_each_next_token_modulo_its_width():
    """`output_classes` (a mixture search's cheap proxy): the head has that many rows, training's loss and
    evaluation's held-out loss are the cross-entropy of each next token's class (its id modulo the width),
    and the FLOPs estimate shrinks with the head; a tied head cannot be one."""
    from moeflow.moe.evaluate import row_losses

    cfg = MOE.model_copy(update={"tie_embeddings": False, "output_classes": 7})
    torch.manual_seed(0)
    model = Transformer(cfg, vocab_size=50, max_seq_len=16)
    assert model.head.weight.shape == (7, MOE.d_model)
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), (tokens[:, 1:] % 7).reshape(-1))
        ce, _, _ = lm_loss(model, tokens)
    assert logits.shape[-1] == 7
    assert ce.item() == pytest.approx(want.item(), rel=1e-6)
    assert row_losses(model, tokens.numpy(), torch.device("cpu")).mean() == pytest.approx(ce.item(), rel=1e-5)
    full = Transformer(cfg.model_copy(update={"output_classes": None}), vocab_size=50, max_seq_len=16)
    assert full.flops_per_token(16) - model.flops_per_token(16) == 6 * (50 - 7) * MOE.d_model
    with pytest.raises(ValueError, match="output_classes needs tie_embeddings: false"):
        ModelConfig(**{**MOE.model_dump(), "output_classes": 7})


def test_a_factored_head_gives_each_next_token_its_own_cross_entropy():
    """`factored_head`: P(token) = P(its class) x P(token | class), the second a softmax over the class's
    members only. Built here over the whole vocabulary by brute force, it is a distribution (sums to 1), and
    training's and evaluation's losses are its cross-entropy; the FLOPs add only D x (members of a class)."""
    from moeflow.moe.evaluate import row_losses

    vocab, classes = 50, 7  # classes of 8 and of 7 members: the short ones are masked
    cfg = MOE.model_copy(update={"tie_embeddings": False, "output_classes": classes, "factored_head": True})
    torch.manual_seed(0)
    model = Transformer(cfg, vocab_size=vocab, max_seq_len=16)
    tokens = torch.randint(0, vocab, (2, 9))
    with torch.no_grad():
        hidden, _ = model.features(tokens[:, :-1])
        class_lp = model.logits(hidden).log_softmax(-1)
        inner = hidden @ model.within.T
        lp = torch.stack([class_lp[..., t % classes] + inner[..., t]
                          - torch.logsumexp(inner[..., t % classes::classes], -1) for t in range(vocab)], -1)
        ce, _, _ = lm_loss(model, tokens)
    assert torch.logsumexp(lp, -1).abs().max() < 1e-5
    want = -lp.gather(-1, tokens[:, 1:, None]).mean()
    assert ce.item() == pytest.approx(want.item(), rel=1e-5)
    assert row_losses(model, tokens.numpy(), torch.device("cpu")).mean() == pytest.approx(want.item(), rel=1e-5)
    plain = Transformer(cfg.model_copy(update={"factored_head": False}), vocab_size=vocab, max_seq_len=16)
    assert model.flops_per_token(16) - plain.flops_per_token(16) == 6 * MOE.d_model * 8
    assert {metrics.group_of(n) for n, _ in model.named_parameters() if "head" in n or "within" in n} == {"lm_head"}
    with pytest.raises(ValueError, match="factored_head needs output_classes"):
        ModelConfig(**{**MOE.model_dump(), "tie_embeddings": False, "factored_head": True})
