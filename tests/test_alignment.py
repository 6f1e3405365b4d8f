import pytest
import torch

from hf_kvreuse.alignment import align_token_ids, block_token_span


def test_identical_is_one_prefix_span():
    ids = list(range(10, 30))
    al = align_token_ids(ids, ids)
    assert al.prefix_len == 20 and len(al.spans) == 1 and al.matched == 20


def test_non_prefix_span_and_delta():
    shared = list(range(50, 70))
    donor = [1, 2, 3] + shared + [9, 9]
    target = [4, 5, 6, 7, 8] + shared
    al = align_token_ids(donor, target)
    assert al.prefix_len == 0
    assert [(s.donor_start, s.target_start, s.length) for s in al.spans] == [(3, 5, 20)]
    assert al.spans[0].delta == 2
    t2d = al.target_to_donor()
    assert t2d[:5].tolist() == [-1] * 5 and t2d[5:].tolist() == list(range(3, 23))


def test_prefix_then_spans_and_min_span():
    donor = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 7, 7]
    target = [1, 2, 3, 4, 99, 98, 10, 11, 12, 13, 14, 15, 77, 7]
    al = align_token_ids(donor, target, min_span=4)
    assert al.prefix_len == 4
    assert (al.spans[1].donor_start, al.spans[1].target_start, al.spans[1].length) == (4, 6, 6)
    # the lone matching "7" is shorter than min_span: not reused
    assert al.matched == 10
    assert align_token_ids(donor, target, min_span=1).matched == 11


def test_limits_clip_spans():
    shared = list(range(50, 70))
    al = align_token_ids([1] + shared, [2, 3] + shared, donor_limit=11, target_limit=21)
    assert al.target_len == 21
    assert al.matched == 10  # donor positions 1..10 only
    assert all(s.donor_start + s.length <= 11 for s in al.spans)


def test_batch_input_rejected():
    with pytest.raises(ValueError, match="one sequence"):
        align_token_ids(torch.zeros(2, 5, dtype=torch.long), [1, 2])


def test_block_span_straddling_tokens():
    # text: "ab|cd ef|gh" with tokens "ab" "c" "d e" "f g" "h"; block = chars [2, 7) -> "cd ef"
    offsets = [(0, 2), (2, 3), (3, 6), (6, 8), (8, 9)]
    # block start at a token start: token 1 opens the block; token 3 ("f g", starts at 6 < 7) straddles the
    # block end and joins the block
    assert block_token_span(offsets, 2, 7) == (1, 4)
    # block starting inside token 2 ("d e", 3..6): that token stays with the prefix
    assert block_token_span(offsets, 4, 9) == (3, 5)
    # empty block
    assert block_token_span(offsets, 6, 6) == (3, 3)


@pytest.mark.slow
def test_segment_real_tokenizer_reassembles(smollm2):
    from hf_kvreuse.alignment import segment_prompt

    _, tok = smollm2
    prefix, block, suffix = "You are a careful planner.", " The shared question: what is 2+2?", " Answer:"
    text = prefix + block + suffix
    ids, [(s, e)] = segment_prompt(tok, text, [(len(prefix), len(prefix) + len(block))])
    full = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, full) and 0 < s < e <= ids.shape[1]
    assert "shared question" in tok.decode(ids[0, s:e])


def test_reordered_blocks_are_found():
    a, b, c = list(range(100, 120)), list(range(200, 215)), list(range(300, 330))
    donor = [1, 2] + a + [3] + b + [4] + c
    target = [9] + c + [8] + a + b
    al = align_token_ids(donor, target)
    t2d = al.target_to_donor().tolist()
    assert al.matched == len(a) + len(b) + len(c)
    assert t2d[1:31] == list(range(donor.index(300), donor.index(300) + 30))
    assert t2d[32:52] == list(range(2, 22))
    assert [target[t] for t, d in enumerate(t2d) if d >= 0] == [donor[d] for d in t2d if d >= 0]


def test_every_match_is_a_true_match_random():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        donor = torch.randint(0, 6, (200,), generator=g).tolist()  # tiny vocab: many repeats
        target = donor[50:120] + torch.randint(0, 6, (30,), generator=g).tolist() + donor[:40]
        al = align_token_ids(donor, target, min_span=5)
        t2d = al.target_to_donor().tolist()
        assert all(target[t] == donor[d] for t, d in enumerate(t2d) if d >= 0)
        assert all(s.length >= 5 for s in al.spans[1 if al.prefix_len else 0:])
        assert al.matched >= 100  # both copied blocks are found (possibly split differently)
