"""FreeBlockQueue: a doubly linked list with O(1) remove, push-front and push-back."""

import pytest

from engine.core.block_pool import FreeBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def assert_links_consistent(queue: FreeBlockQueue) -> None:
    """Walk forward and backward: both directions must agree with block_ids()."""
    forward = queue.block_ids()
    backward = []
    node = queue._tail.prev_free
    while node is not None and node is not queue._head:
        backward.append(node.block_id)
        node = node.prev_free
    assert backward == forward[::-1]
    assert len(queue) == len(forward)


def test_initial_order_is_block_id_order():
    queue, _ = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert len(queue) == 5
    assert_links_consistent(queue)


def test_empty_queue():
    queue, _ = make_queue(0)
    assert queue.block_ids() == []
    assert len(queue) == 0
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_takes_front_and_unlinks():
    queue, blocks = make_queue(3)
    first = queue.popleft()
    assert first is blocks[0]
    assert first.prev_free is None and first.next_free is None
    assert queue.block_ids() == [1, 2]
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[2]
    assert len(queue) == 0
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_remove_from_the_middle():
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    # Neighbours are relinked directly.
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert_links_consistent(queue)


def test_remove_front_and_back():
    queue, blocks = make_queue(4)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queue.block_ids() == [1, 2]
    assert_links_consistent(queue)


def test_remove_is_constant_time_per_call():
    # O(1): removal touches only the block and its neighbours; nothing else is visited.
    queue, blocks = make_queue(1000)
    untouched = [b for b in blocks if b.block_id not in (499, 500, 501)]
    before = [(b.prev_free, b.next_free) for b in untouched]
    queue.remove(blocks[500])
    after = [(b.prev_free, b.next_free) for b in untouched]
    assert before == after
    assert len(queue) == 999


def test_append_goes_to_back():
    queue, blocks = make_queue(3)
    block = queue.popleft()
    queue.append(block)
    assert queue.block_ids() == [1, 2, 0]
    assert_links_consistent(queue)


def test_appendleft_goes_to_front():
    queue, blocks = make_queue(3)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert queue.block_ids() == [2, 0, 1]
    assert queue.popleft() is blocks[2]
    assert_links_consistent(queue)


def test_mixed_operations_order():
    queue, blocks = make_queue(5)
    a, b = queue.popleft(), queue.popleft()  # 0, 1
    queue.remove(blocks[3])  # [2, 4]
    queue.append(a)  # [2, 4, 0]
    queue.appendleft(b)  # [1, 2, 4, 0]
    queue.append(blocks[3])  # [1, 2, 4, 0, 3]
    assert queue.block_ids() == [1, 2, 4, 0, 3]
    assert len(queue) == 5
    assert_links_consistent(queue)


def test_append_into_empty_queue():
    queue, blocks = make_queue(1)
    block = queue.popleft()
    queue.appendleft(block)
    assert queue.block_ids() == [0]
    queue.remove(block)
    queue.append(block)
    assert queue.block_ids() == [0]
    assert_links_consistent(queue)


def test_double_append_raises():
    queue, blocks = make_queue(3)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.appendleft(blocks[0])
    # The failed inserts changed nothing.
    assert queue.block_ids() == [0, 1, 2]
    assert_links_consistent(queue)


def test_double_remove_raises():
    queue, blocks = make_queue(3)
    queue.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    assert queue.block_ids() == [0, 2]
    assert len(queue) == 2


def test_remove_of_never_queued_block_raises():
    queue, _ = make_queue(2)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(KVCacheBlock(7))
    assert len(queue) == 2


def test_duplicate_block_in_constructor_raises():
    block = KVCacheBlock(0)
    with pytest.raises(ValueError):
        FreeBlockQueue([block, block])
