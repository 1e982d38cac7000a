"""From a batch of token samples to the GPT model's inputs (left-to-right LM)."""
import torch


def ltor_masks_and_position_ids(tokens, eod: int, reset_position_ids: bool,
                                reset_attention_mask: bool, eod_mask_loss: bool):
    """Loss mask [b, s], attention mask (None for plain causal, else bool
    [b, 1, s, s] with True where attention is forbidden) and position ids [b, s].

    reset_* restart positions / attention after each end-of-document token, so a
    sample spanning documents does not attend across their boundary.
    """
    b, s = tokens.shape
    loss_mask = torch.ones((b, s), dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long, device=tokens.device).unsqueeze(0).repeat(b, 1)
    if not (reset_position_ids or reset_attention_mask):
        return loss_mask, None, position_ids
    allowed = torch.tril(torch.ones((s, s), dtype=torch.bool, device=tokens.device)).repeat(b, 1, 1)
    for i in range(b):
        prev = 0
        for j in (tokens[i] == eod).nonzero().flatten().tolist():
            if reset_attention_mask:
                allowed[i, j + 1:, : j + 1] = False
            if reset_position_ids:
                position_ids[i, j + 1:] -= j + 1 - prev
                prev = j + 1
    mask = None if not reset_attention_mask else (~allowed).unsqueeze(1)
    return loss_mask, mask, position_ids


def gpt_batch(data: dict, eod: int, device, reset_position_ids=False, reset_attention_mask=False,
              eod_mask_loss=False):
    """tokens, labels, loss_mask, attention_mask, position_ids from {"text": [b, s + 1]}."""
    text = data["text"].long().to(device)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask, mask, position_ids = ltor_masks_and_position_ids(
        tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss)
    return tokens, labels, loss_mask, mask, position_ids
