"""The tree of a run: every descendant of a row, from the children index, in one nogil pass
(abort walks only the tree it ends, never the whole table); every action of a run, from its
list of parentless actions (``u_child``) and their trees (a run's first watch reads only its
own rows)."""

from cext._types cimport check_index, i32, i64, u8

__all__ = ["descendants", "link_roots", "run_rows", "unlink_children", "unlink_roots"]


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
    out[0] = root
    return _breadth_first(child, sibling, out, 1)


cdef Py_ssize_t _breadth_first(const i32[::1] child, const i32[::1] sibling, i64[::1] out,
                               Py_ssize_t n) noexcept nogil:
    # The descendants of out[:n] appended breadth first, ``out`` itself the queue; the new
    # count, or -1 when they do not fit.
    cdef Py_ssize_t head = 0, cap = out.shape[0]
    cdef i32 kid
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


def run_rows(const i32[::1] run_child not None, const i32[::1] child not None,
             const i32[::1] sibling not None, i64 run, i64[::1] out not None):
    """Write every action row of run row ``run`` into ``out`` (its parentless actions, the
    list ``run_child[run]`` links through ``sibling``, then their descendants, breadth first)
    and return how many; ``out`` must have room for them (the action table's size always
    does)."""
    check_index(run, run_child.shape[0], "run", "a run row")
    if sibling.shape[0] != child.shape[0]:
        raise ValueError("child and sibling columns differ in length")
    cdef Py_ssize_t n = 0, cap = out.shape[0]
    cdef i32 kid
    with nogil:
        kid = run_child[run]
        while kid >= 0 and n < cap:
            out[n] = kid
            n += 1
            kid = sibling[kid]
        if kid >= 0:
            n = -1
        else:
            n = _breadth_first(child, sibling, out, n)
    if n < 0:
        raise ValueError(f"out has room for {out.shape[0]} rows, the run is larger (or the "
                         f"children index has a cycle)")
    return n


def link_roots(i32[::1] run_child not None, i32[::1] sibling not None,
               const i32[:] run not None, const i64[::1] roots not None):
    """Link the parentless action rows ``roots`` (ascending) into their runs' lists
    (``run_child``, through ``sibling``), each row ahead of those before it: the lists as
    enqueues leave them when rows were taken in row order."""
    cdef Py_ssize_t i
    cdef i64 r
    cdef i32 u
    _check_rows_and_runs(roots, sibling.shape[0], run, run_child.shape[0], "roots")
    with nogil:
        for i in range(roots.shape[0]):
            r = roots[i]
            u = run[r]
            sibling[r] = run_child[u]
            run_child[u] = <i32>r


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
        if not 0 <= rows[i] < mark.shape[0]:
            check_index(rows[i], mark.shape[0], f"rows[{i}]", "an action row")
    with nogil:
        _unlink(child, sibling, parent, mark, mark, rows)


def unlink_roots(i32[::1] run_child not None, i32[::1] sibling not None,
                 const i32[:] run not None, u8[::1] mark not None, u8[::1] seen not None,
                 const i64[::1] rows not None):
    """Take the parentless action rows ``rows`` (each with ``mark[row] == 1``) out of their
    runs' lists (``run_child``): one walk of each run's list. ``seen`` (one byte per run
    row, zero) is scratch: runs visited are set to 2."""
    if seen.shape[0] != run_child.shape[0] or mark.shape[0] > sibling.shape[0]:
        raise ValueError("run lists, mark and seen differ in length")
    _check_rows_and_runs(rows, mark.shape[0], run, run_child.shape[0], "rows")
    with nogil:
        _unlink(run_child, sibling, run, mark, seen, rows)


cdef int _check_rows_and_runs(const i64[::1] rows, Py_ssize_t n_rows, const i32[:] run,
                              Py_ssize_t n_runs, str name) except -1:
    # Each of ``rows`` an action row and its run a run row (the message is formatted only
    # for the error: not once a row).
    cdef Py_ssize_t i
    for i in range(rows.shape[0]):
        if not 0 <= rows[i] < n_rows:
            check_index(rows[i], n_rows, f"{name}[{i}]", "an action row")
        if not 0 <= run[rows[i]] < n_runs:
            check_index(run[rows[i]], n_runs, f"run of {name}[{i}]", "a run row")
    return 0


cdef void _unlink(i32[::1] child, i32[::1] sibling, const i32[:] owner, u8[::1] mark,
                  u8[::1] seen, const i64[::1] rows) noexcept nogil:
    # Each owner's list (a parent's children, a run's parentless actions) walked once.
    cdef Py_ssize_t i
    cdef i32 p, kid, prev, nxt
    for i in range(rows.shape[0]):
        p = owner[rows[i]]
        if p < 0 or seen[p] == 2:
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
        seen[p] = 2
