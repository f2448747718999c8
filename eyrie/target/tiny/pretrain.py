"""Teach a tiny target the bundled demo conversations, so its greedy outputs are regular and a drafter has
something to learn (a random target's next token is noise, and acceptance would mean nothing)."""

from __future__ import annotations


def pretrain_on_demo_data(
    model, tokenizer, steps: int = 200, seq_len: int = 128, batch_size: int = 8, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """Causal-LM training on the chat-rendered demo conversations; returns the loss curve (every 50 steps)."""
    import torch

    from eyrie.target.tiny.demo_data import conversations

    stream: list[int] = []
    for row in conversations():
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(stream)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    curve = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            curve.append(round(loss.item(), 4))
    model.eval()
    return curve
