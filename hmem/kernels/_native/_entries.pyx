# cython: language_level=3
"""Native scan and join of a bulk put's entries (hmem/store/prepare.py).

`Store.put_many` of many small entries spent about 2.6 us per entry in
Python just unpacking each (keys, values, layer, importance) tuple and
checking the arrays' types and shapes, more than the signature of the
entry.  Here the common form is checked in one pass, and the rows of every
entry are joined with the GIL released.  hmem.kernels.reference.entries is
the twin: the same answers, in Python.

- scan_entries(items, dim, max_tokens, max_layer, max_importance, tokens,
  layers, weights, entry_type=None): walks the list `items` while each is
  a plain tuple (keys, values, layer_idx, importance), or an instance of
  the tuple subclass `entry_type` (keys, values, layer_idx, importance,
  meta) whose meta is None, and its keys and values are
  numpy.ndarray objects of native float32, C-contiguous, of shape
  [n, dim] with 0 < n <= max_tokens (both the same shape), layer_idx an
  int in [0, max_layer] and importance a float in [0, max_importance].
  Fills tokens[i] (n), layers[i] and weights[i] of each such entry;
  returns the index of the first entry that is not of that form, or
  len(items).  Entries not of the form are for the caller's general path,
  which converts them or says what is wrong.
- join_rows(items, starts, k_out, v_out, entry_type=None): copies the keys of entry e
  (scanned as above) into rows starts[e] .. starts[e + 1] - 1 of k_out, its
  values into those of v_out.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, strcmp

import numpy as np

include "one_path.pxi"

_NDARRAY = np.ndarray


cdef int _rows_view(object array, Py_ssize_t dim, Py_ssize_t max_tokens, Py_buffer *view):
    """1 with `view` holding the array's buffer when it is an ndarray of
    native float32 rows [n, dim], C-contiguous, 0 < n <= max_tokens; else 0
    (nothing held)."""
    if type(array) is not _NDARRAY:
        return 0
    try:
        PyObject_GetBuffer(array, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, ValueError, TypeError):
        return 0
    if (view.ndim != 2 or view.itemsize != 4 or view.format == NULL or strcmp(view.format, b"f") != 0
            or view.shape[1] != dim or view.shape[0] <= 0 or view.shape[0] > max_tokens):
        PyBuffer_Release(view)
        return 0
    return 1


cdef inline bint _common(object item, object entry_type):
    """A plain 4-tuple, or an entry_type 5-tuple without meta."""
    if type(item) is tuple:
        return len(<tuple>item) == 4
    return (entry_type is not None and type(item) is entry_type and isinstance(item, tuple)
            and len(<tuple>item) == 5 and (<tuple>item)[4] is None)


def scan_entries(list items, Py_ssize_t dim, Py_ssize_t max_tokens, object max_layer, double max_importance,
                 int64_t[::1] tokens, int64_t[::1] layers, double[::1] weights, object entry_type=None):
    cdef Py_ssize_t n = len(items), i
    cdef Py_buffer kview, vview
    cdef double weight
    cdef int same
    if tokens.shape[0] < n or layers.shape[0] < n or weights.shape[0] < n:
        raise ValueError(f"tokens, layers and weights must hold {n} values each")
    for i in range(n):
        item = items[i]
        if not _common(item, entry_type):
            return i
        keys, values, layer, importance = (<tuple>item)[0], (<tuple>item)[1], (<tuple>item)[2], (<tuple>item)[3]
        if type(layer) is not int or not 0 <= layer <= max_layer:
            return i
        if type(importance) is not float:
            return i
        weight = importance
        if not (0.0 <= weight <= max_importance):  # NaN fails both
            return i
        if not _rows_view(keys, dim, max_tokens, &kview):
            return i
        if not _rows_view(values, dim, max_tokens, &vview):
            PyBuffer_Release(&kview)
            return i
        same = vview.shape[0] == kview.shape[0]
        tokens[i] = kview.shape[0]
        PyBuffer_Release(&vview)
        PyBuffer_Release(&kview)
        if not same:
            return i
        layers[i] = layer
        weights[i] = weight
    return n


def join_rows(list items, const int64_t[::1] starts, float[:, ::1] k_out, float[:, ::1] v_out,
              object entry_type=None):
    cdef Py_ssize_t n = len(items), dim = k_out.shape[1], i, held = 0, count
    cdef Py_buffer *views
    cdef char *k_base
    cdef char *v_base
    cdef size_t row_bytes = <size_t>dim * 4
    if starts.shape[0] != n + 1 or v_out.shape[1] != dim or v_out.shape[0] != k_out.shape[0]:
        raise ValueError("starts must hold len(items) + 1 offsets and k_out, v_out the same shape")
    if n and (starts[0] != 0 or starts[n] != k_out.shape[0]):
        raise ValueError("starts must run from 0 to the output's row count")
    if n == 0:
        return
    k_base = <char *>&k_out[0, 0]
    v_base = <char *>&v_out[0, 0]
    views = <Py_buffer *>malloc(2 * n * sizeof(Py_buffer))
    if views == NULL:
        raise MemoryError()
    try:
        # Hold every entry's buffers (each view keeps its array alive), then
        # copy without the GIL: query threads run meanwhile.
        for i in range(n):
            item = items[i]
            count = starts[i + 1] - starts[i]
            if not _common(item, entry_type):
                raise ValueError(f"entry {i} is not as scan_entries found it")
            if not _rows_view((<tuple>item)[0], dim, count, &views[2 * i]):
                raise ValueError(f"entry {i} is not as scan_entries found it")
            held += 1
            if not _rows_view((<tuple>item)[1], dim, count, &views[2 * i + 1]):
                raise ValueError(f"entry {i} is not as scan_entries found it")
            held += 1
            if views[2 * i].shape[0] != count or views[2 * i + 1].shape[0] != count:
                raise ValueError(f"entry {i} is not as scan_entries found it")
        with nogil:
            for i in range(n):
                memcpy(k_base + <size_t>starts[i] * row_bytes, views[2 * i].buf,
                       <size_t>(starts[i + 1] - starts[i]) * row_bytes)
                memcpy(v_base + <size_t>starts[i] * row_bytes, views[2 * i + 1].buf,
                       <size_t>(starts[i + 1] - starts[i]) * row_bytes)
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        free(views)
