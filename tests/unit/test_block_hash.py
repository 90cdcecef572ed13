"""The shared block hash: stable encoding, chaining, extra keys, and no torch import."""

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.contracts.block_hash import DIGEST_SIZE, ROOT_HASH, hash_block, hash_token_blocks

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 4
TOKENS = list(range(1, 13))  # 12 tokens = 3 full blocks at block size 4


def test_root_hash_is_pinned():
    expected = hashlib.blake2b(b"kvfleet.block_hash.v1", digest_size=16).digest()
    assert expected == ROOT_HASH
    assert ROOT_HASH.hex() == "672cd5983e137da52cf6737ed493021b"


def test_known_digests_pin_the_encoding():
    # Changing the byte encoding breaks engine/router agreement across versions: pin it.
    first = hash_block(None, [1, 2, 3, 4])
    assert first.hex() == "97bb81888c0158f6b11b183b6e1c8e21"
    second = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], BLOCK_SIZE)[1]
    assert second.hex() == "b93683196b9835d8f40bdbb16bbcdbb9"


def test_digest_is_128_bit_bytes():
    digest = hash_block(None, [0, 0, 0, 0])
    assert isinstance(digest, bytes)
    assert len(digest) == DIGEST_SIZE == 16


def test_deterministic_across_calls():
    assert hash_token_blocks(TOKENS, BLOCK_SIZE) == hash_token_blocks(list(TOKENS), BLOCK_SIZE)
    assert hash_block(None, (5, 6, 7, 8)) == hash_block(None, [5, 6, 7, 8])


def test_deterministic_across_processes():
    # Python's hash() is randomised per process; ours must not be.
    code = (
        "from kvfleet.contracts.block_hash import hash_token_blocks;"
        "print(','.join(h.hex() for h in hash_token_blocks(list(range(1, 13)), 4)))"
    )
    outputs = set()
    for seed in ("1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(result.stdout.strip())
    assert outputs == {",".join(h.hex() for h in hash_token_blocks(TOKENS, BLOCK_SIZE))}


def test_chain_equals_manual_chaining():
    hashes = hash_token_blocks(TOKENS, BLOCK_SIZE)
    h0 = hash_block(None, [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    h2 = hash_block(h1, [9, 10, 11, 12])
    assert hashes == [h0, h1, h2]


def test_all_hashes_distinct_for_repeated_content():
    # The same four tokens at different depths hash differently (the parent differs).
    hashes = hash_token_blocks([7, 7, 7, 7] * 3, BLOCK_SIZE)
    assert len(set(hashes)) == 3


def test_changing_block_zero_changes_every_later_hash():
    base = hash_token_blocks(TOKENS, BLOCK_SIZE)
    changed = hash_token_blocks([99] + TOKENS[1:], BLOCK_SIZE)
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_changing_last_block_keeps_earlier_hashes():
    base = hash_token_blocks(TOKENS, BLOCK_SIZE)
    changed = hash_token_blocks(TOKENS[:-1] + [99], BLOCK_SIZE)
    assert changed[:2] == base[:2]
    assert changed[2] != base[2]


def test_cache_salt_changes_first_and_therefore_all_hashes():
    base = hash_token_blocks(TOKENS, BLOCK_SIZE)
    salted = hash_token_blocks(TOKENS, BLOCK_SIZE, cache_salt="tenant-a")
    other = hash_token_blocks(TOKENS, BLOCK_SIZE, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(base, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    # Same salt, same chain.
    assert salted == hash_token_blocks(TOKENS, BLOCK_SIZE, cache_salt="tenant-a")


def test_salt_only_enters_first_block():
    salted = hash_token_blocks(TOKENS, BLOCK_SIZE, cache_salt="tenant-a")
    # Blocks after the first are chained plainly from the salted parent.
    assert salted[1] == hash_block(salted[0], TOKENS[4:8])
    assert salted[1] == hash_block(salted[0], TOKENS[4:8], cache_salt="ignored for non-root")


def test_empty_salt_differs_from_no_salt():
    assert hash_block(None, [1, 2, 3, 4], cache_salt="") != hash_block(None, [1, 2, 3, 4])


def test_lora_id_changes_every_hash():
    base = hash_token_blocks(TOKENS, BLOCK_SIZE)
    lora = hash_token_blocks(TOKENS, BLOCK_SIZE, lora_id="adapter-1")
    other = hash_token_blocks(TOKENS, BLOCK_SIZE, lora_id="adapter-2")
    assert all(a != b for a, b in zip(base, lora, strict=True))
    assert all(a != b for a, b in zip(lora, other, strict=True))
    # LoRA enters every block, not only the first.
    assert lora[1] != hash_block(lora[0], TOKENS[4:8])
    assert lora[1] == hash_block(lora[0], TOKENS[4:8], lora_id="adapter-1")


def test_salt_and_lora_are_not_interchangeable():
    assert hash_block(None, [1, 2, 3, 4], cache_salt="x") != hash_block(
        None, [1, 2, 3, 4], lora_id="x"
    )


@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2), (12, 3)]
)
def test_only_full_blocks_are_hashed(num_tokens, num_hashes):
    hashes = hash_token_blocks(list(range(num_tokens)), BLOCK_SIZE)
    assert len(hashes) == num_hashes
    assert hashes == hash_token_blocks(list(range(num_tokens + 100)), BLOCK_SIZE)[:num_hashes]


def test_partial_tail_does_not_affect_full_block_hashes():
    assert hash_token_blocks(TOKENS + [1, 2, 3], BLOCK_SIZE) == hash_token_blocks(
        TOKENS, BLOCK_SIZE
    )


@pytest.mark.parametrize("start_block", [1, 2])
def test_resuming_a_chain_equals_hashing_from_scratch(start_block):
    full = hash_token_blocks(TOKENS, BLOCK_SIZE, cache_salt="s", lora_id="l")
    resumed = hash_token_blocks(
        TOKENS,
        BLOCK_SIZE,
        cache_salt="s",
        lora_id="l",
        parent=full[start_block - 1],
        start_block=start_block,
    )
    assert resumed == full[start_block:]


def test_resuming_past_the_end_yields_nothing():
    full = hash_token_blocks(TOKENS, BLOCK_SIZE)
    assert hash_token_blocks(TOKENS, BLOCK_SIZE, parent=full[-1], start_block=3) == []


def test_token_values_are_not_truncated():
    # Large vocab ids must not collide modulo a narrow integer width.
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1 + 2**16, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1 + 2**8, 2, 3, 4])


def test_block_length_is_part_of_the_hash():
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 3, 0])


def test_import_does_not_pull_in_torch():
    code = (
        "import sys, kvfleet.contracts.block_hash; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_engine_core_imports_do_not_pull_in_torch():
    code = (
        "import sys, engine.core.scheduler, engine.core.kv_cache_manager, engine.core.request;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def _chained(tokens, block_size, cache_salt, lora_id, parent, start_block):
    """The definition: `hash_block` applied block by block."""
    hashes = []
    for i in range(start_block, len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size],
                            cache_salt=cache_salt, lora_id=lora_id)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("seed", range(40))
def test_whole_prompt_hashing_equals_the_per_block_definition(seed):
    # hash_token_blocks encodes the prompt once; engines and routers must still agree with
    # hash_block bit for bit, for every combination of salt, adapter and resumed chain.
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16, 32])
    tokens = [rng.choice([0, 1, 2**16, 2**32 - 1, rng.randrange(2**32)])
              for _ in range(rng.randrange(0, 12 * block_size))]
    salt = rng.choice([None, "", "tenant-ä", "t" * 300])
    lora = rng.choice([None, "", "adapter-1", "ü" * 70])
    start_block = rng.randrange(0, 4)
    parent = rng.choice([None, rng.randbytes(16)])
    expected = _chained(tokens, block_size, salt, lora, parent, start_block)
    assert hash_token_blocks(tokens, block_size, cache_salt=salt, lora_id=lora,
                             parent=parent, start_block=start_block) == expected
    assert hash_token_blocks(tuple(tokens), block_size, cache_salt=salt, lora_id=lora,
                             parent=parent, start_block=start_block) == expected


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_a_token_outside_uint32_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="token_ids"):
        hash_token_blocks([1, 2, 3, bad], BLOCK_SIZE)
