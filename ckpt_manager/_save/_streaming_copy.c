/* A copy that streams its stores past the cache, for the staging copy (`chunk_copy.py`).
 *
 * [Note: the staging copy streams past the cache] A snapshot copies the whole training state
 * into a slab that nobody reads back soon (the writer writes it out later, a restore maps it
 * after a failure). With ordinary stores each destination line is first read into the cache
 * (read-for-ownership) and then evicts a line the training was using; glibc's `memmove` takes
 * its non-temporal path only above a threshold (190 MiB on the 2-core VM, 3/4 of the shared
 * cache), which the staging copy's 256 KiB chunks never reach. Here every full 64-byte line of
 * the destination is written with non-temporal stores: no read of the destination, no
 * eviction of the training's working set. The source is read as usual and stays in cache, so
 * the checksum that follows each chunk reads the source, not the slab.
 * The lines are copied four 4 KiB strides at a time, one line from each per round (as glibc's
 * own large copy does), which keeps more DRAM pages open at once than one running stream.
 * Measured on the 2-core VM (128 MiB in 256 KiB chunks, CPU time against torch's one-thread
 * `copy_`): 0.51 memcpys for the copy, 0.67 for the staging copy with its CRC-32C, against
 * 0.92 and 1.14 through `memmove` (`bench/save_cpu_floor.py --size-mib 128`). Off x86-64 the
 * module copies with `memcpy` and says so (`NON_TEMPORAL` false), and the Python side keeps
 * `memmove`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_NON_TEMPORAL 1
#else
#define HAVE_NON_TEMPORAL 0
#endif

#define LINE_BYTES 64
#define STRIDE_BYTES 4096
#define STRIDES 4

#if HAVE_NON_TEMPORAL
/* One 64-byte line: unaligned loads from the source, streaming stores to the aligned
 * destination. */
static inline void stream_line(char *dst, const char *src)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

static void stream_copy(char *dst, const char *src, size_t n)
{
    /* Ordinary stores up to the destination's first line boundary. */
    size_t head = (LINE_BYTES - ((uintptr_t)dst & (LINE_BYTES - 1))) & (LINE_BYTES - 1);
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    while (n >= STRIDES * STRIDE_BYTES) {
        for (size_t at = 0; at < STRIDE_BYTES; at += LINE_BYTES) {
            for (size_t s = 0; s < STRIDES; s++) {
                stream_line(dst + s * STRIDE_BYTES + at, src + s * STRIDE_BYTES + at);
            }
        }
        dst += STRIDES * STRIDE_BYTES;
        src += STRIDES * STRIDE_BYTES;
        n -= STRIDES * STRIDE_BYTES;
    }
    while (n >= LINE_BYTES) {
        stream_line(dst, src);
        dst += LINE_BYTES;
        src += LINE_BYTES;
        n -= LINE_BYTES;
    }
    /* Streaming stores are weakly ordered: fence them before anyone is told the bytes are
     * there. */
    _mm_sfence();
    memcpy(dst, src, n);
}
#endif

PyDoc_STRVAR(copy_doc,
"copy(dst, src, nbytes, /)\n--\n\n"
"Copy `nbytes` from address `src` to address `dst` (the ranges must not overlap), with\n"
"non-temporal stores where `NON_TEMPORAL` is true. Releases the GIL. The caller keeps both\n"
"buffers alive for the call.");

static PyObject *streaming_copy(PyObject *module, PyObject *args)
{
    unsigned long long dst_address, src_address;
    Py_ssize_t nbytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst_address, &src_address, &nbytes)) {
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes=%zd: use 0 or more", nbytes);
        return NULL;
    }
    if (nbytes == 0) {
        Py_RETURN_NONE;
    }
    if (dst_address == 0 || src_address == 0) {
        PyErr_SetString(PyExc_ValueError, "a null address: pass both buffers' addresses");
        return NULL;
    }
    unsigned long long size = (unsigned long long)nbytes;
    if (dst_address > UINTPTR_MAX - size || src_address > UINTPTR_MAX - size) {
        PyErr_SetString(PyExc_ValueError, "an address range wraps around the address space");
        return NULL;
    }
    if (dst_address < src_address + size && src_address < dst_address + size) {
        PyErr_SetString(PyExc_ValueError,
                        "the two ranges overlap: this copy is for a slab and its source only");
        return NULL;
    }
    char *dst = (char *)(uintptr_t)dst_address;
    const char *src = (const char *)(uintptr_t)src_address;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_NON_TEMPORAL
    stream_copy(dst, src, (size_t)size);
#else
    memcpy(dst, src, (size_t)size);
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", streaming_copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "ckpt_manager._save._streaming_copy",
    "A byte copy with non-temporal stores for the staging copy ([Note: the staging copy streams "
    "past the cache]).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__streaming_copy(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "NON_TEMPORAL", HAVE_NON_TEMPORAL) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
