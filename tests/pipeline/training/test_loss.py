"""pipeline/training/loss.py: the one token loss, summed over unmasked targets in fp32."""

import math

import pytest
import torch

from pipeline.model.transformer import Transformer, build_config
from pipeline.training.loss import IGNORE_INDEX, scored_tokens, token_loss_sum

VOCAB = 97


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(build_config("tiny", VOCAB)).eval()


def test_loss_is_summed_cross_entropy_over_unmasked_targets():
    idx, targets = tokens(2, 10), tokens(2, 10, seed=2)
    targets[0, :4] = IGNORE_INDEX
    targets[1, 7:] = IGNORE_INDEX
    logits = model()(idx)
    loss = token_loss_sum(logits, targets)

    keep = targets != IGNORE_INDEX
    log_probs = logits.double().log_softmax(-1)
    nll = -log_probs[keep].gather(-1, targets[keep][:, None]).squeeze(-1)
    torch.testing.assert_close(loss.double(), nll.sum(), rtol=1e-6, atol=1e-6)
    assert int(scored_tokens(targets)) == int(keep.sum()) == 13

    # the ignored positions really are left out: counting them changes the loss
    assert not torch.isclose(loss, token_loss_sum(logits, tokens(2, 10, seed=2)))


def test_loss_is_fp32_when_the_model_runs_in_bf16():
    m = model().to(torch.bfloat16)
    logits = m(tokens(2, 8))
    assert logits.dtype == torch.bfloat16
    assert token_loss_sum(logits, tokens(2, 8, seed=2)).dtype == torch.float32


def test_token_id_0_is_a_target_like_any_other():
    """Only IGNORE_INDEX is left out: id 0 is a real token (ours: a special one)."""
    targets = torch.tensor([[0, 5, IGNORE_INDEX], [IGNORE_INDEX, 0, 0]])
    assert int(scored_tokens(targets)) == 4
    logits = torch.zeros(2, 3, 8)
    logits[..., 0] = math.log(7.0)  # p(0) = 7/14 = 1/2, p(5) = 1/14
    expected = 3 * math.log(2) + math.log(14)
    assert float(token_loss_sum(logits, targets)) == pytest.approx(expected, rel=1e-6)
