"""Training with the zoo: Ouro's expected-loss objective, loop sampling, a short run whose loss
falls, torch.compile, and DDP / FSDP2 on two gloo processes giving single-process gradients."""
import math
import os
import random

import pytest
import torch
import torch.multiprocessing as mp

import zoo
from helpers import single_thread  # noqa: F401 (fixture)
from zoo.training import exit_entropy, expected_exit_loss, sample_num_loops, step_cross_entropy

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = dict(model_type="ouro", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, total_ut_steps=3, max_position_embeddings=64,
            torch_dtype="float32")


def tiny_model(**overrides):
    return zoo.from_config({**TINY, **overrides}, seed=0).train()


def random_ids(batch, seq, vocab=128, seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randint(3, vocab, (batch, seq), generator=gen)


# ----- the objective ---------------------------------------------------------------------------
def test_expected_exit_loss_on_a_hand_checked_case():
    # one scored position (label at t=1; t=2's label is ignored), two loops, two classes
    step_logits = torch.tensor([[[[0.0, 0.0], [5.0, -5.0], [1.0, 2.0]]],
                                [[[0.0, math.log(3.0)], [-5.0, 5.0], [2.0, 1.0]]]])      # [S=2, B=1, T=3, V=2]
    labels = torch.tensor([[0, 1, -100]])
    pdf = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]], requires_grad=True)       # [B, T, S]
    ce = [math.log(2.0), math.log(4.0 / 3.0)]          # -log softmax([0,0])[1], -log softmax([0,log 3])[1]
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    beta = 0.1
    out = expected_exit_loss(step_logits, pdf, labels, entropy_weight=beta)
    assert out.loss.item() == pytest.approx(0.25 * ce[0] + 0.75 * ce[1] - beta * entropy, abs=1e-6)
    assert out.step_losses.tolist() == pytest.approx(ce, abs=1e-6)
    assert out.entropy.item() == pytest.approx(entropy, abs=1e-6)
    out.loss.backward()
    # d/dp_s [sum p CE - beta H(p)] = CE_s + beta (log p_s + 1); the ignored and last positions get 0
    expected_grad = [ce[0] + beta * (math.log(0.25) + 1), ce[1] + beta * (math.log(0.75) + 1)]
    assert pdf.grad[0, 0].tolist() == pytest.approx(expected_grad, abs=1e-6)
    assert pdf.grad[0, 1:].abs().max().item() == 0.0


def test_step_cross_entropy_matches_per_step_functional_and_accepts_a_list():
    logits, labels = torch.randn(3, 2, 5, 11), torch.randint(0, 11, (2, 5))
    ce = step_cross_entropy(logits, labels)
    assert ce.shape == (3, 2, 4)
    for s in range(3):
        ref = torch.nn.functional.cross_entropy(logits[s, :, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
        assert ce[s].mean().item() == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(step_cross_entropy(list(logits), labels), ce, atol=0, rtol=0)


def test_exit_entropy_is_zero_for_a_certain_exit_and_log_s_for_uniform():
    pdf = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]], requires_grad=True)
    h = exit_entropy(pdf)
    assert h.tolist() == pytest.approx([0.0, math.log(4)], abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(pdf.grad).all()


def test_ouro_expected_loss_option_matches_the_helper_and_reaches_every_parameter():
    model = tiny_model()
    ids = random_ids(2, 12)
    out = model(ids, labels=ids, loss_type="expected_loss", entropy_weight=0.2, return_step_logits=True)
    ref = expected_exit_loss(out.step_logits, out.exit_pdf, ids, entropy_weight=0.2)
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-6)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_default_loss_is_unchanged_and_options_are_validated():
    model = tiny_model()
    ids = random_ids(1, 10)
    out = model(ids, labels=ids, return_step_logits=True)
    expected_logits = (out.exit_pdf.permute(2, 0, 1)[..., None] * out.step_logits).sum(0)
    assert out.loss.item() == pytest.approx(zoo.base.causal_lm_loss(expected_logits, ids).item(), abs=1e-6)
    with pytest.raises(ValueError, match="loss_type"):
        model(ids, labels=ids, loss_type="mean")
    with pytest.raises(ValueError, match="entropy_weight"):
        model(ids, labels=ids, entropy_weight=0.1)


# ----- loop sampling ---------------------------------------------------------------------------
def test_sampled_loop_counts_have_the_asked_mean_and_bounds():
    gen = torch.Generator().manual_seed(1234)
    draws = [sample_num_loops(8.0, sigma=0.5, generator=gen) for _ in range(4000)]
    # Poisson-lognormal: std ~ sqrt(7 + 49 (e^0.25 - 1)) ~ 4.6, so the mean of 4000 is within ~0.07
    assert sum(draws) / len(draws) == pytest.approx(8.0, abs=0.3)
    assert min(draws) >= 1 and max(draws) > 12                   # a right tail deeper than the mean
    capped = [sample_num_loops(4.0, min_loops=2, max_loops=6, generator=gen) for _ in range(500)]
    assert min(capped) >= 2 and max(capped) == 6
    with pytest.raises(ValueError, match="mean_loops"):
        sample_num_loops(1.0)


def test_forward_runs_any_sampled_depth():
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    ids = random_ids(1, 8)
    for _ in range(3):
        loops = sample_num_loops(3.0, max_loops=6, generator=gen)
        out = model(ids, num_loops=loops, labels=ids, loss_type="expected_loss")
        assert out.exit_pdf.shape[-1] == loops and torch.isfinite(out.loss)


# ----- a short training run --------------------------------------------------------------------
def grammar_text(num_sentences, seed):
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a bird"]
    verbs = ["sees", "likes", "finds", "follows"]
    objects = ["the moon", "a red ball", "the river", "some bread"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
                    for _ in range(num_sentences))


def test_loss_falls_below_bound_in_200_steps():
    data = torch.tensor(list(grammar_text(600, seed=random.randrange(1 << 30)).encode()))   # bytes as ids
    train, valid = data[:-1024], data[-1024:].view(-1, 32)
    model = tiny_model(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                       total_ut_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        starts = torch.randint(0, train.numel() - 32, (8,), generator=gen)
        ids = train[starts[:, None] + torch.arange(32)]
        model(ids, labels=ids, loss_type="expected_loss", entropy_weight=0.05).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        out = model(valid, return_step_logits=True)
    losses = step_cross_entropy(out.step_logits, valid).mean((1, 2))
    # from ln(128) = 4.85 at init; the grammar leaves ~0.2 nats/byte; unigram statistics alone ~2.9
    assert losses[-1].item() < 0.6, losses


# ----- torch.compile ---------------------------------------------------------------------------
def test_compiled_forward_with_checkpointing_matches_eager():
    model = tiny_model()
    model.gradient_checkpointing_enable()
    ids = random_ids(2, 12)
    eager = model(ids, labels=ids, loss_type="expected_loss")
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # aot_eager traces forward and backward (the graph capture a GPU's inductor build starts from)
    # without the minutes of C++ compilation inductor needs on this CPU; fullgraph: no graph breaks
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(ids, labels=ids, loss_type="expected_loss")
    out.loss.backward()
    assert out.loss.item() == pytest.approx(eager.loss.item(), abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# ----- DDP and FSDP2 on two gloo processes -----------------------------------------------------
def _data_parallel_worker(rank, world_size, store_path, result_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    ids = random_ids(4, 12, seed=7)
    local = ids.chunk(world_size)[rank]                        # each rank: its half of the batch
    model = tiny_model()
    wrapped = DistributedDataParallel(model)                   # must outlive backward: its hooks reduce
    wrapped(local, labels=local, loss_type="expected_loss").loss.backward()
    ddp = {n: p.grad.clone() for n, p in model.named_parameters()}

    sharded = tiny_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded(local, labels=local, loss_type="expected_loss").loss.backward()
    fsdp = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    saved = zoo.saving.weights_to_save(sharded, torch.float32)   # gathers the shards (collective)
    if rank == 0:
        torch.save({"ddp": ddp, "fsdp": fsdp, "saved": saved}, result_path)
    # both ranks leave together, and without the interpreter's teardown: destroying gloo's threads
    # at exit (after the barrier, with destroy_process_group too) aborted now and then ("terminate
    # called without an active exception", SIGABRT); rank 0's file is closed by now
    dist.barrier()
    os._exit(0)


def test_ddp_and_fsdp2_gradients_equal_one_process_on_the_whole_batch(tmp_path):
    result_path = tmp_path / "grads.pt"
    mp.spawn(_data_parallel_worker, args=(2, str(tmp_path / "store"), str(result_path)), nprocs=2)
    result = torch.load(result_path)
    model = tiny_model()
    ids = random_ids(4, 12, seed=7)
    # equal halves of equal length: the mean over the batch is the mean of the ranks' means
    model(ids, labels=ids, loss_type="expected_loss").loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(result["ddp"][name], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"ddp {name}: {m}")
        torch.testing.assert_close(result["fsdp"][name], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"fsdp {name}: {m}")
    for name, tensor in zoo.saving.weights_to_save(model, torch.float32).items():
        torch.testing.assert_close(result["saved"][name], tensor, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
