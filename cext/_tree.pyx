"""The tree of a run: every descendant of a row, from the children index, in one nogil pass
(abort walks only the tree it ends, never the whole table)."""

from cext._types cimport check_index, i32, i64, u8

__all__ = ["descendants", "unlink_children"]


def descendants(const i32[::1] child not None, const i32[::1] sibling not None, i64 root,
                i64[::1] out not None):
    """Write ``root`` and every descendant into ``out`` breadth first (a row's children
    newest first, as the index holds them) and return how many; ``out`` must have room for
    them (the action table's size always does)."""
    check_index(root, child.shape[0], "root", "an action row")
    if sibling.shape[0] != child.shape[0]:
        raise ValueError("child and sibling columns differ in length")
    if out.shape[0] < 1:
        raise ValueError("out has no room")
    cdef Py_ssize_t n
    with nogil:
        n = _descendants(child, sibling, root, out)
    if n < 0:
        raise ValueError(f"out has room for {out.shape[0]} rows, the tree is larger (or the "
                         f"children index has a cycle)")
    return n


cdef Py_ssize_t _descendants(const i32[::1] child, const i32[::1] sibling, i64 root,
                             i64[::1] out) noexcept nogil:
    # Breadth first, using ``out`` itself as the queue; -1 when it does not fit.
    cdef Py_ssize_t head = 0, n = 1, cap = out.shape[0]
    cdef i32 kid
    out[0] = root
    while head < n:
        kid = child[out[head]]
        head += 1
        while kid >= 0:
            if n == cap:
                return -1
            out[n] = kid
            n += 1
            kid = sibling[kid]
    return n


def unlink_children(i32[::1] child not None, i32[::1] sibling not None,
                    const i32[::1] parent not None, u8[::1] mark not None,
                    const i64[::1] rows not None):
    """Take ``rows`` (each with ``mark[row] == 1``) out of their parents' children lists:
    one walk of each parent's list, whatever the number of its rows taken out. ``mark``
    (one byte per row, zero elsewhere) is scratch: parents visited are set to 2."""
    cdef Py_ssize_t n = child.shape[0], i
    if sibling.shape[0] != n or parent.shape[0] < mark.shape[0] or mark.shape[0] > n:
        raise ValueError("children columns and mark differ in length")
    for i in range(rows.shape[0]):
        check_index(rows[i], mark.shape[0], f"rows[{i}]", "an action row")
    with nogil:
        _unlink(child, sibling, parent, mark, rows)


cdef void _unlink(i32[::1] child, i32[::1] sibling, const i32[::1] parent, u8[::1] mark,
                  const i64[::1] rows) noexcept nogil:
    cdef Py_ssize_t i
    cdef i32 p, kid, prev, nxt
    for i in range(rows.shape[0]):
        p = parent[rows[i]]
        if p < 0 or mark[p] == 2:
            continue
        prev = -1
        kid = child[p]
        while kid >= 0:
            nxt = sibling[kid]
            if mark[kid] == 1:
                if prev < 0:
                    child[p] = nxt
                else:
                    sibling[prev] = nxt
                sibling[kid] = -1
            else:
                prev = kid
            kid = nxt
        mark[p] = 2
