"""The code the four scripts share, tested in each: the sampler's masks and its draws, log-probs against a full
log_softmax, gradient checkpointing, sampling exactly as Args say, float32 weights under bf16 compute, no dropout,
micro-batches of whole groups, one `compute_policy_loss` signature, and the plumbing's text, the same in all four."""

import glob
import inspect
import math
import os
import re

import pytest
import torch
import tyro
from conftest import MODULES, OWN_ARGS, ScriptedRewards
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TopPLogitsWarper)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    return model, AutoTokenizer.from_pretrained(tiny_model, padding_side="left")


@pytest.mark.parametrize("module", MODULES)
def test_token_logprobs_match_log_softmax_and_ignore_left_padding(module, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]  # a 3-token prompt + 3 completion tokens; the second is padded
    ids = torch.tensor([rows[0], [0, 0, 0] + rows[1]])
    attention = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    logprobs, entropy = module.token_logprobs(model, ids, attention, 2, temperature=0.7)
    for i, row in enumerate(rows):
        logits = model(torch.tensor([row])).logits[0, -3:-1] / 0.7  # unpadded, no position trick needed
        full = torch.log_softmax(logits, -1)
        assert torch.allclose(logprobs[i], full[[0, 1], row[-2:]], atol=1e-5)
        assert torch.allclose(entropy[i], -(full.exp() * full).sum(-1), atol=1e-5)


class FixedGenerator(torch.nn.Module):
    """Stands in for a model: `generate` returns fixed completions, to test the masks exactly."""

    def __init__(self, completions):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.completions = torch.tensor(completions)
        self.config = LlamaConfig(num_hidden_layers=1)  # attention layers: a cache that can be shared

    def forward(self, input_ids, attention_mask, position_ids, use_cache, cache, logits_to_keep):  # the prompt pass
        self.prompt_rows = len(input_ids)

    def generate(self, input_ids, attention_mask, generation_config, logits_processor, synced_gpus, cache):
        assert synced_gpus is False  # ranks decode on their own (the weights are gathered first)
        return torch.cat([input_ids, self.completions], 1)


@pytest.mark.parametrize("module", MODULES)
def test_sample_masks_up_to_first_eos_and_marks_truncation(module, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    completions = [[5, eos, pad, pad], [5, 6, 7, 8], [eos, 5, eos, pad], [5, 6, 7, eos]]
    generator = FixedGenerator(completions)
    config = GenerationConfig(eos_token_id=[eos])
    batch = module.sample(generator, tokenizer, [[9], [9, 9]], 2, config, None)
    out, attention, mask = batch.input_ids, batch.attention_mask, batch.completion_mask
    assert generator.prompt_rows == 2  # each prompt computed once, then repeated for its 2 completions
    assert out.shape == (4, 6) and out[:, :2].tolist() == [[pad, 9], [pad, 9], [9, 9], [9, 9]]  # repeat_interleave
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.truncated.tolist() == [False, True, False, False]
    assert attention[:, :2].tolist() == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert batch.completions == ["1", "1234", "", "123"]  # cut at the first EOS; ids 4.. are "0123..."


@pytest.mark.parametrize("module", MODULES)
def test_gradient_checkpointing_recomputes_the_forward_in_the_backward_pass(module, tiny_model):
    """HF checkpoints activations only in train mode: load_model must leave the model in it, or --gradient-checkpointing
    would silently save nothing. A checkpointed layer runs its modules again in the backward."""
    ids, attention = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    recomputed = []
    for checkpointing in (False, True):
        _, model = module.load_model(tiny_model)
        if checkpointing:
            model.gradient_checkpointing_enable()
        calls = []  # the attention's pre-hook runs again when the layer is recomputed
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, inputs, calls=calls: calls.append(1))
        logprobs, _ = module.token_logprobs(model, ids, attention, 2, 1.0)
        forwards = len(calls)
        logprobs.sum().backward()
        recomputed.append(len(calls) - forwards)
    assert recomputed == [0, 1]


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_model, tmp_path_factory) -> str:
    """The tiny model, saved with a generation config that would change sampling if it were merged in."""
    path = str(tmp_path_factory.mktemp("generation_config_model"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config = GenerationConfig(do_sample=True, temperature=3.0, top_k=3, top_p=0.5,
                                               repetition_penalty=5.0, no_repeat_ngram_size=1, max_new_tokens=2,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


@pytest.mark.parametrize("module", MODULES)
def test_greedy_sampling_ignores_the_checkpoints_generation_config(module, model_with_generation_config):
    """Greedy `sample()` must give the argmax of the model's own distribution at every position: no repetition
    penalty, no n-gram ban, no do_sample or length limit merged in from the saved generation_config.json."""
    tokenizer, model = module.load_model(model_with_generation_config)
    eos_ids = model.generation_config.eos_token_id
    greedy = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    prompts = [tokenizer("12+3=").input_ids, tokenizer("7").input_ids]
    torch.manual_seed(0)
    batch = module.sample(model, tokenizer, prompts, 2, greedy, None)
    out, attention_mask, completion_mask = batch.input_ids, batch.attention_mask, batch.completion_mask
    T = completion_mask.shape[1]
    assert T == 12 or not completion_mask.all()  # no max_new_tokens=2 from the saved config
    with torch.no_grad():
        logprobs, _ = module.token_logprobs(model, out, attention_mask, T, 1.0)  # (B, T)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=out, attention_mask=attention_mask, position_ids=position_ids).logits[:, -T - 1 : -1]
    best = torch.log_softmax(logits.float(), -1).max(-1).values  # (B, T)
    real = completion_mask.bool()
    assert torch.allclose(logprobs[real], best[real], atol=1e-5)  # every sampled token is the argmax
    assert torch.equal(out[0], out[1])  # greedy: the two copies of a prompt agree


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("module", MODULES)
def test_the_draw_follows_softmax_of_logits_over_temperature_in_the_top_p_nucleus(module, top_p):
    """200,000 draws from 4 rows of 5 tokens: each token's frequency within 0.005 (over 4 standard errors) of its
    probability under softmax(logits / 0.7), renormalised over the nucleus that transformers' own top-p keeps; the
    tokens outside it never drawn; and all that generate keeps is the drawn token (-inf elsewhere)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.1, 0.2, 0.3, 0.4], [5.0, 0.0, 0.1, 0.2, -9.0],
                           [0.3, 0.2, 0.1, 0.0, 1.0]])  # (no ties, where top-p could keep either token)
    expected = torch.softmax(logits / 0.7, -1)
    if top_p < 1:
        kept = TopPLogitsWarper(top_p)(None, logits / 0.7) > -math.inf
        expected = expected * kept / (expected * kept).sum(-1, keepdim=True)
    draw, counts = module.SoftmaxDraw(0.7, top_p), torch.zeros(4, 5)
    torch.manual_seed(0)
    for _ in range(2000):
        scores = draw(None, logits.repeat(25, 1))  # (100, 5)
        assert ((scores == 0).sum(-1) == 1).all() and ((scores == 0) | (scores == -math.inf)).all()
        counts += (scores == 0).view(25, 4, 5).sum(0)
    frequencies = counts / counts.sum(-1, keepdim=True)
    assert (frequencies - expected).abs().max() < 0.005
    assert (counts[expected == 0] == 0).all()


@pytest.mark.parametrize("module", MODULES)
def test_each_prompt_runs_once_in_sampling_and_the_draws_are_those_of_plain_generate(module, tiny_model):
    """`sample` runs each prompt once and copies its keys and values to its `repeat` rows before decoding: with the
    same seed it must draw the tokens of one plain `generate` over the repeated, left-padded prompts, from the same
    logits."""
    tokenizer, model = module.load_model(tiny_model)
    eos_ids = model.generation_config.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    draw = module.SoftmaxDraw(1.0, 1.0)
    prompts = [tokenizer(text).input_ids for text in ["7", "1+2=", "12+34=?"]]  # 2, 5 and 8 tokens
    generate, logits = model.generate, []

    def generate_keeping_logits(**kwargs):  # the logits each decoding step sampled from
        result = generate(**kwargs, output_logits=True, return_dict_in_generate=True)
        logits.append(torch.stack(result.logits, 1))  # (B, T, V)
        return result.sequences

    model.generate = generate_keeping_logits
    torch.manual_seed(0)
    batch = module.sample(model, tokenizer, prompts, 3, config, draw)
    out, completion_mask = batch.input_ids, batch.completion_mask
    width = max(map(len, prompts))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(3, 0)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(3, 0)
    torch.manual_seed(0)
    expected = model.eval().generate(input_ids=input_ids, attention_mask=prompt_mask, generation_config=config,
                                     logits_processor=LogitsProcessorList([draw]))
    assert completion_mask.sum(1).max() >= 5  # completions long enough to tell wrong keys and values apart
    assert torch.equal(out, expected)
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["shared_prompt", "gradient_checkpointing"])
def test_each_prompt_computed_once_gives_the_log_probs_and_gradients_of_whole_rows(module, checkpointing, tiny_model):
    """Two groups of 3 (prompts of 4 and 2 tokens, left-padded; completions of 1 to 5 tokens, right-padded): log-probs
    and gradients through the shared prompt pass must equal one plain pass over each whole row."""
    _, model = module.load_model(tiny_model)
    if checkpointing:  # checkpointed layers drop a cache, so then the rows run whole
        model.gradient_checkpointing_enable()
    prompts, prompt_mask = [[5, 6, 7, 8], [0, 0, 9, 10]], [[1, 1, 1, 1], [0, 0, 1, 1]]
    lengths = [3, 2, 5, 2, 3, 1]  # completion lengths; the token after the last real one is padding (0)
    completions = [[11 + i + t if t < n else 0 for t in range(5)] for i, n in enumerate(lengths)]
    ids = torch.tensor([prompts[i // 3] + c for i, c in enumerate(completions)])  # (6, 9)
    attention = torch.tensor([prompt_mask[i // 3] + [int(t < n) for t in range(5)] for i, n in enumerate(lengths)])
    mask = attention[:, 4:].float()  # (6, 5)
    weights = torch.arange(1.0, 7.0)[:, None] * mask  # a different weight per row, so a mixed-up row would show

    def plain():
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
        return torch.log_softmax(logits[:, -6:-1] / 0.7, -1).gather(-1, ids[:, -5:, None]).squeeze(-1)  # (6, 5)

    results = []
    for compute in (plain, lambda: module.token_logprobs(model, ids, attention, 5, 0.7)[0]):
        model.zero_grad()
        logprobs = compute()
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach() * mask, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (expected, expected_grad), (got, got_grad) = results
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(got_grad, expected_grad, atol=1e-4 * expected_grad.abs().max().item())
    rows = torch.tensor([0, 4, 5])  # a micro-batch with one row of the first group and two of the second
    with torch.no_grad():
        assert torch.allclose(module.token_logprobs(model, ids[rows], attention[rows], 5, 0.7)[0] * mask[rows],
                              expected[rows], atol=1e-5)


@pytest.mark.parametrize("module", MODULES)
def test_micro_batches_keep_groups_whole_and_lengths_together(module):
    lengths = torch.tensor([3, 9, 1, 1, 2, 2, 8, 1])  # groups of 2: longest 9, 1, 2, 8
    mask = (torch.arange(10)[None] < lengths[:, None]).long()  # (8, 10)
    batches = module.micro_batches(torch.tensor([7, 0, 1, 2, 3, 4, 5, 6]), mask, 2, 4)
    assert [b.tolist() for b in batches] == [[2, 3, 4, 5], [6, 7, 0, 1]]  # by the group's longest, then by index


DROPOUT = {  # GPT-2 has nn.Dropout modules; Llama's attention reads config.attention_dropout itself in train mode
    "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=21, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                         resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)),
    "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=21, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, max_position_embeddings=64, attention_dropout=0.5)),
}


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("architecture", DROPOUT)
def test_dropout_is_off_so_log_probs_repeat(module, architecture, tiny_model, tmp_path):
    """A model with dropout at p = 0.5, in train mode: the same tokens must get the same log-probs."""
    model_class, config = DROPOUT[architecture]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    _, model = module.load_model(str(tmp_path))
    assert model.training
    ids, attention = torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), torch.ones(1, 7, dtype=torch.long)
    first, _ = module.token_logprobs(model, ids, attention, 5, 1.0)
    second, _ = module.token_logprobs(model, ids, attention, 5, 1.0)
    assert torch.equal(first, second)


@pytest.mark.parametrize("module", MODULES)
def test_bfloat16_compute_trains_float32_weights_that_move(module, tiny_model, copy_task, tmp_path, monkeypatch):
    """--dtype bfloat16: one AdamW step at lr 1e-5 must change most weights. In bf16 weights such a step is below the
    resolution of nearly every entry (|w| > ~3e-3), so bf16 weights would not move at all."""
    monkeypatch.setattr(module.rewards, "score", ScriptedRewards([[1, 0, 0, 1, 0, 1, 1, 0]]))  # contrast in both groups
    monkeypatch.chdir(tmp_path)
    argv = ["--model", tiny_model, "--task", copy_task, "--dtype", "bfloat16", "--steps", "1", "--learning-rate",
            "1e-5", "--eval-every", "0", "--num-prompts", "2", "--group-size", "4", "--num-minibatches", "1",
            "--max-new-tokens", "4", "--output-dir", "ckpt"]
    argv += OWN_ARGS.get(module.__name__, [])
    module.main(tyro.cli(module.Args, args=argv))
    (last,) = glob.glob(os.path.join("ckpt", "*", "step_1"))
    trained = AutoModelForCausalLM.from_pretrained(last, dtype="auto").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    changed = sum((trained[k] != v).sum().item() for k, v in initial.items())
    total = sum(v.numel() for v in initial.values())
    assert all(v.dtype == torch.float32 for v in trained.values())
    assert changed / total > 0.5, f"{changed / total:.1%} of the entries changed"


def shared_text(module) -> tuple[str, ...]:
    """A script's text below the plumbing marker, and that of the functions of a step that every script calls alike
    above it."""
    with open(module.__file__) as f:
        source = f.read()
    functions = (module.Batch, module.shuffled, module.SoftmaxDraw, module.sample, module.sample_vllm, module.evaluate,
                 module.micro_batches, module.reference_logprobs)
    return (source[re.search(r"^# -+ plumbing", source, re.M).start():], *map(inspect.getsource, functions))


# parametrized by script, so that `pytest -k NAME` selects these two for a fork named NAME (docs/fork.md)
@pytest.mark.parametrize("module", MODULES)
def test_the_plumbing_and_the_step_s_shared_functions_are_identical_in_all_four_scripts(module):
    """The shared text is grpo.py's in every script (a fork's too), so `diff` shows only the algorithm."""
    assert shared_text(module) == shared_text(MODULES[0]), f"see diff grpo.py {module.__name__}.py"
    assert len(shared_text(module)[0].splitlines()) > 300


@pytest.mark.parametrize("module", MODULES)
def test_every_script_shares_compute_policy_loss_signature(module):
    parameters = list(inspect.signature(module.compute_policy_loss).parameters)
    assert parameters == ["logprobs", "old_logprobs", "ref_logprobs", "sampler_logprobs", "advantages", "mask", "args"]


@pytest.mark.parametrize("module", MODULES)
def test_log_ratios_past_20_are_clamped_before_exp_so_the_loss_stays_finite(module):
    check_log_ratios_past_20_are_clamped(module)


def check_log_ratios_past_20_are_clamped(module):
    """What any loss built on the ratio exp(clamp(log w, -20, 20)) and the k3 KL's exp(clamp(ref - logp, -20, 20))
    satisfies, whatever it computes from them (tests/test_fork.py runs it on the guide's forks; each script's own
    numbers, GRPO's e^20 and 1 - eps, are in its own test file). One token, A = 1 and -1, beta 0.1, the old and the
    reference log-probs log w below the current one: at log w = +-100 (exp(100) is inf in float32) the loss, its
    gradient and its statistics are finite, the loss and the KL are those at +-20 and +-21, and the gradient is that at
    +-21: no gradient flows through the clamped ratio or KL (a term on log pi itself, as CISPO's, keeps its own)."""
    mask = torch.ones(1, 1)
    for advantage in (1.0, -1.0):
        for sign in (1, -1):
            results = []
            for size in (20, 21, 100):
                logprobs = torch.tensor([[-1.0]], requires_grad=True)
                old = logprobs.detach() - sign * size  # log w = sign * size; the reference's log-probs too
                # one completion's advantage, or (PPO) its one token's
                advantages = torch.tensor([advantage])
                loss, stats = module.compute_policy_loss(logprobs, old, old, old, advantages, mask,
                                                         module.Args(beta=0.1))
                (grad,) = torch.autograd.grad(loss, logprobs)
                assert math.isfinite(loss.item()) and math.isfinite(grad.item())
                assert all(math.isfinite(value) for value in stats.values()), stats
                results.append((loss.item(), stats["kl"], grad.item()))
            (loss_20, kl_20, _), (loss_21, kl_21, grad_21), (loss_100, kl_100, grad_100) = results
            assert loss_21 == pytest.approx(loss_20, rel=1e-6) and loss_100 == pytest.approx(loss_20, rel=1e-6)
            assert kl_21 == pytest.approx(kl_20, rel=1e-6) and kl_100 == pytest.approx(kl_20, rel=1e-6)
            assert grad_100 == pytest.approx(grad_21, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("module", MODULES)
def test_lora_trains_only_its_adapters_and_its_reference_is_the_base_model(module, tiny_model):
    """--lora-rank 2: adapters on every linear layer of the decoder (4 attention + 3 MLP per layer, not the LM head),
    the only trainable weights; with the adapter off (the reference policy) the log-probs are the base model's; the
    prompt-sharing forward still equals whole rows."""
    _, base = module.load_model(tiny_model)
    model = module.add_lora(module.load_model(tiny_model)[1], module.Args(lora_rank=2))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * base.config.num_hidden_layers and all("lora_" in n for n in trainable)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0 (the adapter then changes nothing): move it
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.tensor([[5, 6, 7, 11, 12, 13], [5, 6, 7, 14, 15, 0]])
    attention = (ids > 0).long()
    with torch.no_grad():
        adapted = module.token_logprobs(model, ids, attention, 3, 0.7)[0]
        with module.adapter_off(model):
            reference = module.token_logprobs(model, ids, attention, 3, 0.7)[0]
        expected = module.token_logprobs(base, ids, attention, 3, 0.7)[0]
        whole = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, 2:5] / 0.7, -1)
    assert torch.allclose(reference, expected, atol=1e-6) and not torch.allclose(adapted, expected, atol=1e-3)
    assert torch.allclose(adapted * attention[:, 3:], whole.gather(-1, ids[:, 3:, None]).squeeze(-1) * attention[:, 3:],
                          atol=1e-5)


@pytest.mark.parametrize("module", MODULES)
def test_run_names_are_folder_names_on_any_system(module, tmp_path, monkeypatch):
    """The task in a run's name: a file or folder by its base name, and no ':' or '/' (a drive or host separator)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two_rows.parquet").write_text("")
    for task, name in [("reasoning_gym:chain_sum", "reasoning_gym_chain_sum"), ("./two_rows.parquet", "two_rows"),
                       ("openai/gsm8k", "openai_gsm8k")]:
        args, state = module.resume(module.Args(task=task, exp_name="x", seed=3))
        run_dir, writer = module.start_run(args, state, 1, "")  # rank 1: it writes no file
        assert os.path.basename(run_dir).startswith(f"{name}__x__3__") and writer is None
        assert not os.path.exists(tmp_path / "runs")
