"""The keep pattern of core/dropout.py: Philox-4x32-10 as published, and one draw per four keys."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn_ck.core.dropout import keep_mask, philox

# Random123's known-answer vectors for Philox-4x32-10: (counter words, key words) -> output words.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

coordinate = st.integers(0, 2 ** 31 - 1)


def test_philox_gives_the_published_known_answers():
    for counter, (key_low, key_high), expected in KNOWN_ANSWERS:
        words = philox(key_low | key_high << 32, *(torch.tensor([word], dtype=torch.int64) for word in counter))
        assert tuple(int(word) for word in words) == expected


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(-(2 ** 63), 2 ** 63 - 1), offset=st.integers(0, 2 ** 32 - 1), batch_index=st.integers(0, 7),
       head=st.integers(0, 15), row=coordinate, group=st.integers(0, 2 ** 29), p=st.floats(0.01, 0.99))
def test_four_neighbouring_keys_take_the_four_words_of_one_draw(seed, offset, batch_index, head, row, group, p):
    """Keys 4g .. 4g + 3 of a row take words 0 .. 3 of the draw at counter (g, row, plane), as docs/semantics.md."""
    heads = 16
    plane = offset + batch_index * heads + head
    counter = (group, row, plane & 0xFFFFFFFF, plane >> 32)
    words = philox(seed, *(torch.tensor([word], dtype=torch.int64) for word in counter))
    expected = [float(int(word) >> 8) * 2.0 ** -24 >= p for word in words]
    mask = keep_mask((seed, offset), p, batch_index, heads, torch.tensor([head]), torch.tensor([row]),
                     torch.arange(4 * group, 4 * group + 4))
    assert mask.flatten().tolist() == expected


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(-(2 ** 63), 2 ** 63 - 1), start=st.integers(0, 61), stop=st.integers(1, 64))
def test_a_slice_of_keys_draws_what_the_whole_row_draws(seed, start, stop):
    """Only coordinates enter the pattern: keys [start, stop) drawn alone (a chunk that need not start on a
    group of four) equal the same keys of the whole row."""
    stop = max(stop, start + 1)
    rows, heads = torch.arange(5), torch.tensor([0, 3])
    whole = keep_mask((seed, 7), 0.3, 2, 4, heads, rows, torch.arange(64))
    part = keep_mask((seed, 7), 0.3, 2, 4, heads, rows, torch.arange(start, stop))
    assert torch.equal(part, whole[..., start:stop])


def test_kept_share_and_neighbours_are_independent():
    """Over 2**20 elements the kept share is 1 - p within 5 standard deviations, and a key and its neighbour in
    the same draw agree as often as independent draws would."""
    p, rows, cols = 0.3, torch.arange(256), torch.arange(4096)
    mask = keep_mask((12345, 678), p, 0, 1, torch.tensor([0]), rows, cols)[0].to(torch.float64)
    count = mask.numel()
    assert abs(mask.mean().item() - (1 - p)) < 5 * (p * (1 - p) / count) ** 0.5
    same_draw = (mask[:, 0::4] == mask[:, 1::4]).to(torch.float64).mean().item()
    agree = p * p + (1 - p) * (1 - p)
    assert abs(same_draw - agree) < 5 * (agree * (1 - agree) / (count / 4)) ** 0.5
