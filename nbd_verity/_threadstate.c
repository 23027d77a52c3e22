/* nbd_verity._threadstate: keep the Python thread state of an nbdkit thread.
 *
 * nbdkit's Python plugin wraps every callback in PyGILState_Ensure/PyGILState_Release.
 * nbdkit's threads are not Python's, so each Ensure makes a new thread state and each
 * Release deletes it again: on every request CPython allocates the state, maps a fresh
 * frame stack (an mmap) on the first call, and unmaps it at the end (a munmap, which
 * makes the kernel flush the TLB of the other cores running this process). keep() takes
 * one more Ensure the first time a thread calls it, so nbdkit's Release only drops the
 * GIL and the state lives on from request to request.
 *
 * The extra reference is given back (the state deleted as nbdkit's own would have been):
 *  - by release(), called from the plugin's close callback: in nbdkit's serialising
 *    thread models requests run on the connection's own thread, which close runs on;
 *  - else when the thread ends (a pthread key's destructor): nbdkit's worker threads
 *    (parallel model) are joined before close, so Python is still running then.
 * A marker in the state's dict clears the key when the state is cleared by anyone, so a
 * state Python deleted itself (a Python thread that called keep()) is never touched
 * again; nothing is touched once the interpreter is finalizing.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdatomic.h>

static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;
static int kept_key_made;
static atomic_long kept_count;  /* thread states kept now, for the leak tests and ctl stats */
static const char MARK[] = "nbd_verity._threadstate";  /* the marker's key and name */

static int finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* The marker, in the kept state's dict, goes when the state is cleared, whoever clears
 * it: nbdkit's Release after release(), Python at the end of its own thread, or
 * release_at_exit. So the key names a live state, or nothing. */
static void marker_gone(PyObject *Py_UNUSED(capsule))
{
    if (kept_key_made && pthread_getspecific(kept_key) != NULL) {
        pthread_setspecific(kept_key, NULL);
        atomic_fetch_sub(&kept_count, 1);
    }
}

/* The key's destructor: a thread ended with its state still kept. No GIL is held, and
 * the C library has already cleared CPython's own key for this thread (so no
 * PyGILState_Release: the state is cleared and deleted as Release would). */
static void release_at_exit(void *state)
{
    PyThreadState *tstate = state;
    if (!Py_IsInitialized() || finalizing())
        return;  /* the interpreter is going away and takes every state with it */
    pthread_setspecific(kept_key, state);  /* the C library cleared it before this call */
    PyEval_RestoreThread(tstate);
    PyThreadState_Clear(tstate);  /* the marker goes: the key is cleared, the count down */
    PyThreadState_DeleteCurrent();  /* and the GIL released */
}

static void make_key(void)
{
    kept_key_made = pthread_key_create(&kept_key, release_at_exit) == 0;
}

static PyObject *keep(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    pthread_once(&kept_once, make_key);
    if (!kept_key_made || pthread_getspecific(kept_key) != NULL)
        Py_RETURN_FALSE;
    PyObject *dict = PyThreadState_GetDict();
    PyObject *marker = PyCapsule_New((void *)MARK, MARK, marker_gone);
    if (dict == NULL || marker == NULL || PyDict_SetItemString(dict, MARK, marker) < 0) {
        Py_XDECREF(marker);
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_DECREF(marker);  /* the dict holds it */
    if (pthread_setspecific(kept_key, PyThreadState_Get()) != 0) {
        PyDict_DelItemString(dict, MARK);
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    atomic_fetch_add(&kept_count, 1);
    PyGILState_Ensure();  /* the GIL is held already: only the state's count goes up */
    Py_RETURN_TRUE;
}

static PyObject *release(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    if (!kept_key_made || pthread_getspecific(kept_key) == NULL)
        Py_RETURN_FALSE;
    /* The caller's own Ensure still holds the state; its Release deletes it, and with it
     * the marker (which clears the key). */
    PyGILState_Release(PyGILState_LOCKED);
    Py_RETURN_TRUE;
}

static PyObject *kept(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyLong_FromLong(atomic_load(&kept_count));
}

static PyMethodDef methods[] = {
    {"keep", keep, METH_NOARGS,
     "keep() -> bool: keep this thread's Python state past the end of the current\n"
     "callback (True the first time on a thread, False after, or if it cannot)."},
    {"release", release, METH_NOARGS,
     "release() -> bool: give back what keep() took on this thread; the state is deleted\n"
     "when the current callback returns (False if this thread kept nothing)."},
    {"kept", kept, METH_NOARGS, "kept() -> int: the thread states kept now."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nbd_verity._threadstate",
    .m_doc = "Keep an nbdkit thread's Python thread state from one callback to the next.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__threadstate(void)
{
    return PyModule_Create(&module);
}
