"""The CPU runtime's weights in transparent huge pages (bloom_hpu/runtime/cpu/huge_pages.py): each
storage's weights copied once into 2 MB pages, every view and tie kept, the same bits, the decode
step reading the copy; generation then gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from bloom_hpu.runtime.cpu import CpuOptions
from bloom_hpu.runtime.cpu.huge_pages import HUGE_PAGE, huge_bytes, huge_zeros, model_tensors, move_weights, thp_mode
from generation import Generator

THP = thp_mode() in ("always", "madvise")


@pytest.fixture
def huge_pages_or_stand_in(monkeypatch):
    """Where Linux offers transparent huge pages, nothing; elsewhere the move is made as if it did,
    without the advice (which such a kernel may refuse), so that its views, bits, ties and order are
    tested on every machine; ``advised`` below is then not asserted."""
    if not THP:
        from bloom_hpu.runtime.cpu import huge_pages

        monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
        monkeypatch.setattr(huge_pages, "advise_huge_pages", lambda mapping: None)
    return THP


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor``'s storage may take huge pages (``THPeligible`` in
    /proc/self/smaps: set by the advice, whatever free 2 MB pages the kernel then finds; how many it
    gave, ``huge_bytes``, depends on the machine's memory, so the tests hold the advice)."""
    start, inside = storage_of(tensor), False
    for line in open("/proc/self/smaps"):
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            low, _, high = head.partition("-")
            inside = int(low, 16) <= start < int(high, 16)
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return False


def test_each_storage_moves_once_with_its_views_and_bits(huge_pages_or_stand_in):
    whole = torch.randn(4096, 1024)  # 16 MB; the module below reaches 10 MB of it
    module = torch.nn.Module()
    module.register_buffer("rows", whole[1000:2000])
    module.register_buffer("block", whole[1500:2600, 3:7])  # overlaps "rows": still one copy
    module.register_buffer("halves", whole.view(torch.bfloat16)[100:1200])  # another dtype, the same storage
    module.small = torch.nn.Linear(64, 64)  # 16 KB: left where it is
    module.tied = torch.nn.Module()
    module.tied.weight = module.small.weight  # one parameter in two modules
    before = {name: t.clone() for name, t in module.named_buffers()}
    small_at = storage_of(module.small.weight)

    moved = move_weights(module)

    first = 100 * 2048 * 2 // 64 * 64  # "halves" starts lowest
    end = (2599 * 1024 + 7) * 4  # the last element "block" reaches, + 1
    assert moved == end - first  # the span reached, not the whole 16 MB
    assert len({storage_of(t) for t in (module.rows, module.block, module.halves)}) == 1
    assert storage_of(module.rows) % HUGE_PAGE == 0
    for name, tensor in module.named_buffers():
        assert torch.equal(tensor.view(torch.uint8), before[name].view(torch.uint8)), name  # the same bits
    assert torch.equal(module.block[:500], module.rows[500:, 3:7])  # still views of one another
    module.rows[600, 4] = 7.0
    assert module.block[100, 1] == 7.0
    assert storage_of(module.small.weight) == small_at and module.tied.weight is module.small.weight
    assert advised(module.rows) or not huge_pages_or_stand_in
    assert move_weights(module) == 0  # moved already


def test_weights_made_in_inference_mode_move_too_and_others_keep_their_gradients(huge_pages_or_stand_in):
    with torch.inference_mode():
        frozen = torch.nn.Linear(1024, 1024)
    trained = torch.nn.Linear(1024, 1024)
    before = frozen.weight.clone(), trained.weight.detach().clone()
    assert move_weights(frozen) == move_weights(trained) == 1024 * 1024 * 4
    assert torch.equal(frozen.weight, before[0]) and torch.equal(trained.weight, before[1])
    assert storage_of(frozen.weight) % HUGE_PAGE == 0 and storage_of(trained.weight) % HUGE_PAGE == 0
    assert (advised(frozen.weight) and advised(trained.weight)) or not huge_pages_or_stand_in
    assert not trained.weight.is_inference() and trained.weight.requires_grad
    trained(torch.randn(3, 1024)).sum().backward()
    assert trained.weight.grad.shape == (1024, 1024)


def test_zeros_in_huge_pages(huge_pages_or_stand_in):
    zeros = huge_zeros((4096, 1024), dtype=torch.bfloat16)
    assert zeros.shape == (4096, 1024) and zeros.dtype == torch.bfloat16 and not zeros.any()
    assert zeros.data_ptr() % HUGE_PAGE == 0
    assert advised(zeros) or not huge_pages_or_stand_in


def test_nothing_moves_where_huge_pages_are_off(monkeypatch):
    from bloom_hpu.runtime.cpu import huge_pages

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    weight = torch.randn(2048, 1024)
    module = torch.nn.Linear(1024, 2048)
    module.weight.data = weight
    assert move_weights(module) == 0 and module.weight.data_ptr() == weight.data_ptr()
    assert not huge_zeros((1024, 1024), dtype=torch.float32).any()


def test_a_model_decodes_from_huge_pages_as_transformers_does(make_ckpt, huge_pages_or_stand_in):
    folder = make_ckpt(hidden_size=512, n_layer=2, n_head=8, seed=5)  # 4 MB weights: moved
    gen = Generator.from_pretrained(folder)
    large = [t for t in model_tensors(gen.model) if t.untyped_storage().nbytes() >= HUGE_PAGE]
    assert len(large) >= 2 and all(storage_of(t) % HUGE_PAGE == 0 for t in large)
    assert all(advised(t) for t in large) or not huge_pages_or_stand_in
    granted = huge_bytes(model_tensors(gen.model))  # the load line says what the kernel gave
    assert ("weights in huge pages" in gen.backend.fast_path) == (granted > 0)
    plan = gen.backend.cpu_plan
    if plan.decode is not None:  # the one-call step reads the moved weights, not the ones loaded
        moved = {storage_of(t) for t in model_tensors(gen.model)}
        assert all(storage_of(w) in moved for w in plan.decode.weights)
    reference = transformers.BloomForCausalLM.from_pretrained(folder).eval()
    for prompt in ["It was the best of times", "Numbers 1 2 3"]:
        ids = gen.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          max_length=len(ids) + 16, do_sample=False, pad_token_id=3)
        assert gen.generate(prompt, max_length=len(ids) + 16)[0].token_ids == expected[0, len(ids):].tolist()

    plain = Generator.from_pretrained(folder, cpu=CpuOptions(huge_pages=False))
    assert "huge pages" not in plain.backend.fast_path
    if thp_mode() == "madvise":  # (with "always" the allocator's memory may take huge pages too)
        assert not any(advised(t) for t in model_tensors(plain.model))
