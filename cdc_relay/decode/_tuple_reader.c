/*
 * One pgoutput TupleData read in one call: the decoder's hot path (every column of every row),
 * and the messages of every transaction (Begin, Insert, Commit) straight from their frames.
 *
 * The pure reader in pgoutput.py (_read_tuple_pure) is the reference and the fallback: this one
 * returns exactly what it returns for every well-formed tuple, and None for anything it would not
 * read, so the caller walks the bytes again with the careful reader that names the error. It
 * never reads outside the buffer: every length is checked against what is left before use.
 *
 * read_tuple(buf: bytes, pos: int, unchanged: object) -> tuple[tuple, int] | None
 *   buf[pos:] starts with the Int16 column count; then per column a kind byte and, for 't' (text)
 *   and 'b' (binary), an Int32 length and that many bytes (a bytes object); 'n' is None and 'u'
 *   is `unchanged` (the UNCHANGED_TOAST sentinel). Returns the values and the offset after them.
 *
 * read_message(frame: buffer, offset: int, insert_type: type, begin_type: type,
 *              commit_type: type, unchanged: object) -> Insert | Begin | Commit | None
 *   The messages of every transaction (outside a stream block) read from the frame as received,
 *   without copying it; trailing bytes ignored, as PgOutputDecoder.decode does:
 *   - Insert: 'I', Int32 relation id, 'N', then a TupleData as above ->
 *     insert_type(relation_id, values, None);
 *   - Begin: 'B', UInt64 final LSN, Int64 commit timestamp, UInt32 xid ->
 *     begin_type(final_lsn, commit_ts, xid);
 *   - Commit: 'C', UInt8 flags, UInt64 commit LSN, UInt64 end LSN, Int64 commit timestamp ->
 *     commit_type(flags, commit_lsn, end_lsn, commit_ts).
 *   Each type a tuple subclass, built as tuple.__new__ builds it. None for any other message and
 *   for anything malformed or short: the caller then decodes it the general way, which names
 *   the error.
 *
 * record_fields(spec: tuple, topics: dict, last: list, reference: callable | None, row: tuple)
 *     -> tuple | None
 *   The plain outbox mapping of an ordinary row (cdc_relay.outbox.OutboxMapping._record_fields is
 *   the reference, and what is called for any other row when given: the mapping binds the first
 *   four arguments with functools.partial, no Python frame per row): spec is (id, aggregate_type, aggregate_id, event_type, payload, headers or -1,
 *   "id", "event_type", "aggregate_type"), the columns' positions then the header names; topics
 *   the mapping's topic cache by (aggregate_type, event_type); last the mapping's list
 *   [aggregate_type, event_type, topic] of the last topic found there (read first: consecutive
 *   rows mostly share their types, and two comparisons cost less than hashing them). Returns (topic, key, value,
 *   headers, event_id, None) when the five columns are bytes, the id is UTF-8, the headers
 *   column is absent or not bytes, and the topic is cached; for anything else (a row that is not
 *   a tuple too), reference(row), which maps the row or says what is wrong with it (None without
 *   a reference).
 *
 * bind(function: callable, obj: object) -> method
 *   types.MethodType(function, obj), without the type call's argument tuple: every record binds
 *   its (transaction, table, topic, headers) to its delivery callback (cdc_relay.session).
 *
 * Deliveries(txn_type: type, by_topic: dict, observe: callable, now: callable,
 *            reference: callable)
 *   A delivery callback, called as (record, err, msg) with record the (transaction, table, topic,
 *   headers) bound to it: DeliveryTracker's Python on_delivery (cdc_relay.publisher), given as
 *   `reference`, without a Python frame per acknowledgement. An ordinary success - no error, a
 *   transaction of exactly txn_type (cdc_relay.watermark.PendingTransaction) with its slots set,
 *   its counts ints, its offsets a dict - is done here, step by step as the reference does it:
 *   txn.offsets[topic, msg.partition()] = msg.offset(); by_topic[topic] += 1; what
 *   txn.acknowledged() does (txn._pending -= 1); then while deliveries remain
 *   txn.unobserved += 1, else observe(now() - txn.commit_time, txn.unobserved + 1) and
 *   txn.unobserved = 0. The slots are read and written where the type keeps them (found once,
 *   from its __slots__ descriptors: a TypeError when txn_type has no such slots, e.g. compiled
 *   with mypyc), msg's methods through the ones cached for its type when it is a C type without
 *   instance dictionaries (confluent-kafka's Message). Anything else, failures included, is
 *   reference(record, err, msg).
 *
 * Publisher(decoder, offset: int, txn_type: type, fast_states: dict, known_topics: set,
 *           produce: callable, produce_failed: callable, callback: callable,
 *           position_header: str, unchanged: object)
 *   Called as (frame, txn) -> bool: decoding an XLogData frame and Session.publish (both in
 *   Python the reference: PgOutputDecoder.decode_xlog in cdc_relay.decode.pgoutput, the loop
 *   of cdc_relay.session) of an Insert's ordinary row, in one call. When decoder (the session's
 *   PgOutputDecoder) is not in a stream block (its slot _in_stream is False), frame[offset:] is
 *   an Insert as read_message reads it, whose relation id has a state in fast_states - the
 *   mapping's (spec, topics, last, table): record_fields' first three arguments and the
 *   table's name -, txn is of exactly txn_type (cdc_relay.watermark.PendingTransaction) with
 *   its events and _pending plain non-negative ints and its position bytes, the row maps as
 *   record_fields maps it (no reference called) and its topic is in known_topics, it does what
 *   publish does, step by step: txn.events += 1; the position header (position_header,
 *   txn.position + b"%d" % txn.events) appended to the record's headers; produce(topic, value,
 *   key, -1, callback bound to (txn, table, topic, headers), None, 0, headers); then what
 *   txn.produced() does (txn._pending += 1), or, when produce raised an Exception (a full
 *   queue, a refusal), publish's handler: produce_failed(exception, txn, table, topic, key,
 *   value, headers, event_id, on_delivery). True then. False for anything else, with nothing
 *   changed but record_fields' cache: the caller decodes and publishes the frame in Python.
 *   Slots found as Deliveries finds them (TypeError without).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/*
 * The values of the TupleData at data[*pos_p:] as a new tuple, *pos_p moved past it. NULL with no
 * exception set when malformed, NULL with one set when memory ran out.
 */
static PyObject *
read_values(const unsigned char *data, Py_ssize_t size, Py_ssize_t *pos_p, PyObject *unchanged)
{
    Py_ssize_t pos = *pos_p;
    if (pos < 0 || size - pos < 2) {
        return NULL;
    }
    Py_ssize_t ncols = ((Py_ssize_t)data[pos] << 8) | data[pos + 1];
    pos += 2;
    PyObject *values = PyTuple_New(ncols);
    if (values == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (pos >= size) {
            goto malformed;
        }
        unsigned char kind = data[pos];
        PyObject *value;
        if (kind == 't' || kind == 'b') {
            if (size - pos < 5) {
                goto malformed;
            }
            uint32_t length = ((uint32_t)data[pos + 1] << 24) | ((uint32_t)data[pos + 2] << 16)
                              | ((uint32_t)data[pos + 3] << 8) | (uint32_t)data[pos + 4];
            Py_ssize_t start = pos + 5;
            /* unsigned: a negative Int32 is too long for any buffer, as in the pure reader */
            if ((uint64_t)length > (uint64_t)(size - start)) {
                goto malformed;
            }
            value = PyBytes_FromStringAndSize((const char *)data + start, (Py_ssize_t)length);
            if (value == NULL) {
                Py_DECREF(values);
                return NULL;
            }
            pos = start + (Py_ssize_t)length;
        }
        else if (kind == 'n') {
            value = Py_NewRef(Py_None);
            pos += 1;
        }
        else if (kind == 'u') {
            value = Py_NewRef(unchanged);
            pos += 1;
        }
        else {
            goto malformed;
        }
        PyTuple_SET_ITEM(values, i, value);
    }
    *pos_p = pos;
    return values;

malformed:
    Py_DECREF(values); /* the items not yet set are NULL: tuple deallocation skips them */
    return NULL;
}

static PyObject *
read_tuple(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_tuple(buf, pos, unchanged) takes 3 arguments");
        return NULL;
    }
    PyObject *buf = args[0];
    if (!PyBytes_CheckExact(buf)) {
        PyErr_SetString(PyExc_TypeError, "read_tuple: buf must be bytes");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *values = read_values((const unsigned char *)PyBytes_AS_STRING(buf),
                                   PyBytes_GET_SIZE(buf), &pos, args[2]);
    if (values == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *end = PyLong_FromSsize_t(pos);
    if (end == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *result = PyTuple_New(2);
    if (result == NULL) {
        Py_DECREF(values);
        Py_DECREF(end);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, values);
    PyTuple_SET_ITEM(result, 1, end);
    return result;
}

static uint64_t
be64(const unsigned char *p)
{
    uint64_t value = 0;
    for (int i = 0; i < 8; i++) {
        value = (value << 8) | p[i];
    }
    return value;
}

static unsigned long
be32(const unsigned char *p)
{
    return ((unsigned long)p[0] << 24) | ((unsigned long)p[1] << 16) | ((unsigned long)p[2] << 8)
           | p[3];
}

/* A new instance of the tuple subclass `type` holding `items` (stolen; NULL items: failed). */
static PyObject *
new_message(PyTypeObject *type, PyObject **items, Py_ssize_t count)
{
    PyObject *message = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (items[i] == NULL) {
            goto fail;
        }
    }
    message = type->tp_alloc(type, count);
    if (message == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyTuple_SET_ITEM(message, i, items[i]);
    }
    return message;

fail:
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(items[i]);
    }
    return NULL;
}

static int
is_tuple_type(PyObject *type)
{
    return PyType_Check(type) && PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type);
}

static PyObject *
read_message(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "read_message(frame, offset, insert_type, begin_type, commit_type, "
                        "unchanged) takes 6 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!is_tuple_type(args[2]) || !is_tuple_type(args[3]) || !is_tuple_type(args[4])) {
        PyErr_SetString(PyExc_TypeError, "read_message: the message types must be tuple subclasses");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)view.buf;
    Py_ssize_t size = view.len;
    PyObject *result = NULL;
    if (offset < 0 || offset >= size) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const unsigned char *p = data + offset + 1; /* after the type byte */
    Py_ssize_t left = size - offset - 1;
    switch (data[offset]) {
    case 'I': {
        if (left < 5 || p[4] != 'N') {
            result = Py_NewRef(Py_None);
            goto done;
        }
        Py_ssize_t pos = offset + 6;
        PyObject *values = read_values(data, size, &pos, args[5]);
        if (values == NULL) {
            if (!PyErr_Occurred()) {
                result = Py_NewRef(Py_None);
            }
            goto done;
        }
        PyObject *items[3] = {PyLong_FromUnsignedLong(be32(p)), values, Py_NewRef(Py_None)};
        /* xid: only inside a stream block */
        result = new_message((PyTypeObject *)args[2], items, 3);
        break;
    }
    case 'B': {
        if (left < 20) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *items[3] = {
            PyLong_FromUnsignedLongLong(be64(p)),
            PyLong_FromLongLong((long long)be64(p + 8)),
            PyLong_FromUnsignedLong(be32(p + 16)),
        };
        result = new_message((PyTypeObject *)args[3], items, 3);
        break;
    }
    case 'C': {
        if (left < 25) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *items[4] = {
            PyLong_FromLong(p[0]),
            PyLong_FromUnsignedLongLong(be64(p + 1)),
            PyLong_FromUnsignedLongLong(be64(p + 9)),
            PyLong_FromLongLong((long long)be64(p + 17)),
        };
        result = new_message((PyTypeObject *)args[4], items, 4);
        break;
    }
    default:
        result = Py_NewRef(Py_None);
    }

done:
    PyBuffer_Release(&view);
    return result;
}

#define SPEC_SIZE 9

/* Whether `known` is a bytes object equal to the bytes object `value`. */
static int
same_bytes(PyObject *known, PyObject *value)
{
    if (known == value) {
        return 1;
    }
    if (!PyBytes_CheckExact(known)) {
        return 0;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(value);
    return PyBytes_GET_SIZE(known) == size
           && memcmp(PyBytes_AS_STRING(known), PyBytes_AS_STRING(value), (size_t)size) == 0;
}

/* An ordinary row's columns and topic, borrowed (the topic from `last`). */
typedef struct {
    PyObject *raw_id, *aggregate_type, *aggregate_id, *event_type, *payload, *topic;
} PlainRow;

/* The columns of an ordinary row, as record_fields takes them (the id's UTF-8 aside), and its
 * cached topic: 1; 0 for any other row; -1 with an exception. The types of spec, topics and
 * last are checked by the caller. Runs no Python code. */
static int
plain_columns(PyObject *row, PyObject *spec, PyObject *topics, PyObject *last, PlainRow *plain)
{
    if (!PyTuple_CheckExact(row)) {
        return 0;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(row);
    PyObject *columns[5];
    for (int i = 0; i < 5; i++) {
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, i));
        if (index == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (index < 0 || index >= size || !PyBytes_CheckExact(PyTuple_GET_ITEM(row, index))) {
            return 0;
        }
        columns[i] = PyTuple_GET_ITEM(row, index);
    }
    PyObject *aggregate_type = columns[1], *event_type = columns[3];
    Py_ssize_t headers_index = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 5));
    if (headers_index == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (headers_index >= 0
        && (headers_index >= size || PyBytes_CheckExact(PyTuple_GET_ITEM(row, headers_index)))) {
        return 0; /* entries to parse, or a row shorter than its relation */
    }
    if (!same_bytes(PyList_GET_ITEM(last, 0), aggregate_type)
        || !same_bytes(PyList_GET_ITEM(last, 1), event_type)) {
        PyObject *key = PyTuple_Pack(2, aggregate_type, event_type);
        if (key == NULL) {
            return -1;
        }
        PyObject *topic = PyDict_GetItemWithError(topics, key);
        Py_DECREF(key);
        if (topic == NULL) {
            return PyErr_Occurred() ? -1 : 0; /* not cached yet: the reference makes it */
        }
        PyObject *entry[3] = {aggregate_type, event_type, topic};
        for (int i = 0; i < 3; i++) {
            /* PyList_SetItem steals the new reference and releases the old item */
            if (PyList_SetItem(last, i, Py_NewRef(entry[i])) < 0) {
                return -1;
            }
        }
    }
    plain->raw_id = columns[0];
    plain->aggregate_type = aggregate_type;
    plain->aggregate_id = columns[2];
    plain->event_type = event_type;
    plain->payload = columns[4];
    plain->topic = PyList_GET_ITEM(last, 2);
    return 1;
}

/* The bytes object's text, strict UTF-8: a new str; NULL without an exception when it is not
 * UTF-8. */
static PyObject *
utf8_text(PyObject *raw)
{
    PyObject *text = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), "strict");
    if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
    }
    return text;
}

/* The three headers every plain record starts with (the names spec's last three items), in a
 * new list with room for `room` more items (set to NULL: the caller sets them). */
static PyObject *
first_headers(PyObject *spec, const PlainRow *plain, Py_ssize_t room)
{
    PyObject *headers = PyList_New(3 + room);
    if (headers == NULL) {
        return NULL;
    }
    PyObject *values[3] = {plain->raw_id, plain->event_type, plain->aggregate_type};
    for (int i = 0; i < 3; i++) {
        PyObject *header = PyTuple_New(2);
        if (header == NULL) {
            Py_DECREF(headers); /* the items not yet set are NULL: list deallocation skips them */
            return NULL;
        }
        PyTuple_SET_ITEM(header, 0, Py_NewRef(PyTuple_GET_ITEM(spec, 6 + i)));
        PyTuple_SET_ITEM(header, 1, Py_NewRef(values[i]));
        PyList_SET_ITEM(headers, i, header);
    }
    return headers;
}

/* record_fields' work: args are (row, spec, topics, last), their types checked by the caller. */
static PyObject *
plain_record(PyObject *const *args)
{
    PlainRow plain;
    int found = plain_columns(args[0], args[1], args[2], args[3], &plain);
    if (found <= 0) {
        return found < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *event_id = utf8_text(plain.raw_id);
    if (event_id == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    PyObject *headers = first_headers(args[1], &plain, 0);
    if (headers == NULL) {
        Py_DECREF(event_id);
        return NULL;
    }
    PyObject *record = PyTuple_New(6);
    if (record == NULL) {
        Py_DECREF(headers);
        Py_DECREF(event_id);
        return NULL;
    }
    PyTuple_SET_ITEM(record, 0, Py_NewRef(plain.topic));
    PyTuple_SET_ITEM(record, 1, Py_NewRef(plain.aggregate_id));
    PyTuple_SET_ITEM(record, 2, Py_NewRef(plain.payload));
    PyTuple_SET_ITEM(record, 3, headers);
    PyTuple_SET_ITEM(record, 4, event_id);
    PyTuple_SET_ITEM(record, 5, Py_NewRef(Py_None));
    return record;
}

static PyObject *
record_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != SPEC_SIZE
        || !PyDict_CheckExact(args[1]) || !PyList_CheckExact(args[2])
        || PyList_GET_SIZE(args[2]) != 3 || (args[3] != Py_None && !PyCallable_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError,
                        "record_fields(spec: tuple, topics: dict, last: list of 3, "
                        "reference: callable | None, row)");
        return NULL;
    }
    PyObject *inner[4] = {args[4], args[0], args[1], args[2]};
    PyObject *record = plain_record(inner);
    if (record == Py_None && args[3] != Py_None) {
        Py_DECREF(record);
        return PyObject_CallOneArg(args[3], args[4]);
    }
    return record;
}

static PyObject *
bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bind(function, obj) takes 2 arguments");
        return NULL;
    }
    /* as types.MethodType checks */
    if (!PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "bind: the first argument must be callable");
        return NULL;
    }
    if (args[1] == Py_None) {
        PyErr_SetString(PyExc_TypeError, "bind: the instance must not be None");
        return NULL;
    }
    return PyMethod_New(args[0], args[1]);
}

/* Deliveries: see the top of the file. */
enum { PENDING, OFFSETS, UNOBSERVED, COMMIT_TIME, SLOTS };
static const char *const slot_names[SLOTS] = {"_pending", "offsets", "unobserved", "commit_time"};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *txn_type;           /* the transactions' exact type, whose slots are read */
    Py_ssize_t at[SLOTS];         /* where its instances hold each slot */
    PyObject *by_topic;           /* a dict (or a subclass: a missing topic is got as [] gets it) */
    int plain_dict;               /* its item assignment is dict's own */
    PyObject *observe;
    PyObject *now;
    PyObject *reference;          /* the Python callback: anything but an ordinary success */
    PyTypeObject *msg_type;       /* the last report type seen, and its two methods, unbound */
    PyObject *partition_of;
    PyObject *offset_of;
} Deliveries;

/* The slot `name` of `type` as __slots__ makes it (an object member, settable): its offset in
 * the instance, or -1 (no exception set) for anything else. */
static Py_ssize_t
slot_offset(PyTypeObject *type, const char *name)
{
    PyObject *descriptor = PyObject_GetAttrString((PyObject *)type, name);
    if (descriptor == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) {
            offset = member->offset;
        }
    }
    Py_DECREF(descriptor);
    return offset;
}

/* slot = value (a new reference, consumed), as a member's setter does it. */
static void
replace_slot(PyObject *obj, Py_ssize_t at, PyObject *value)
{
    PyObject **slot = (PyObject **)((char *)obj + at);
    PyObject *previous = *slot;
    *slot = value;
    Py_XDECREF(previous);
}

/* A new reference to the slot's value, or NULL with AttributeError when it is unset: Python code
 * run meanwhile (a report's value compared, a clock, a histogram) could have changed it since
 * the caller's checks, so every slot is read again where it is used. */
static PyObject *
slot_value(PyObject *obj, Py_ssize_t at, const char *name)
{
    PyObject *value = *(PyObject **)((char *)obj + at);
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%s'",
                     Py_TYPE(obj)->tp_name, name);
        return NULL;
    }
    return Py_NewRef(value);
}

/* *count = a count slot's value, one away from either end of the range: 0, or -1 with an
 * exception set (unset, not an int, out of range). */
static int
slot_count(PyObject *obj, Py_ssize_t at, const char *name, Py_ssize_t *count)
{
    PyObject *value = slot_value(obj, at, name);
    if (value == NULL) {
        return -1;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s is not an int", name);
        Py_DECREF(value);
        return -1;
    }
    *count = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    if (*count == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*count == PY_SSIZE_T_MIN || *count == PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s is out of range", name);
        return -1;
    }
    return 0;
}

/* msg.<method>(): through the method cached for msg's type when it has no instance dictionary
 * that could shadow it, else looked up as Python looks it up. */
static PyObject *
report_call(Deliveries *self, PyObject *msg, PyObject *method, const char *name)
{
    if (method != NULL && (PyTypeObject *)Py_TYPE(msg) == self->msg_type) {
        return PyObject_Vectorcall(method, &msg, 1, NULL);
    }
    return PyObject_CallMethod(msg, name, NULL);
}

/* Cache msg's type's partition and offset methods: C methods of a type without instance
 * dictionaries (confluent-kafka's Message) only; any other type goes the general way. */
static void
learn_report_type(Deliveries *self, PyObject *msg)
{
    PyTypeObject *type = Py_TYPE(msg);
    if (type == self->msg_type) {
        return;
    }
    Py_CLEAR(self->partition_of);
    Py_CLEAR(self->offset_of);
    Py_CLEAR(self->msg_type);
    if (type->tp_dictoffset != 0 || type->tp_getattro != PyObject_GenericGetAttr) {
        return;
    }
    PyObject *partition = PyObject_GetAttrString((PyObject *)type, "partition");
    PyObject *offset = partition ? PyObject_GetAttrString((PyObject *)type, "offset") : NULL;
    if (offset == NULL || !Py_IS_TYPE(partition, &PyMethodDescr_Type)
        || !Py_IS_TYPE(offset, &PyMethodDescr_Type)) {
        PyErr_Clear();
        Py_XDECREF(partition);
        Py_XDECREF(offset);
        return;
    }
    self->msg_type = (PyTypeObject *)Py_NewRef(type);
    self->partition_of = partition;
    self->offset_of = offset;
}

/* The success path of an ordinary record; the caller checked every slot. 0, or -1 with an
 * exception set. The order of Python's statements, one by one. */
static int
delivered(Deliveries *self, PyObject *txn, PyObject *topic, PyObject *msg)
{
    learn_report_type(self, msg);
    /* txn.offsets[topic, msg.partition()] = msg.offset(): the value first, as Python does */
    PyObject *offset = report_call(self, msg, self->offset_of, "offset");
    if (offset == NULL) {
        return -1;
    }
    PyObject *partition = report_call(self, msg, self->partition_of, "partition");
    if (partition == NULL) {
        Py_DECREF(offset);
        return -1;
    }
    PyObject *key = PyTuple_Pack(2, topic, partition);
    Py_DECREF(partition);
    if (key == NULL) {
        Py_DECREF(offset);
        return -1;
    }
    PyObject *offsets = slot_value(txn, self->at[OFFSETS], slot_names[OFFSETS]);
    int stored = offsets == NULL ? -1
                 : PyDict_CheckExact(offsets) ? PyDict_SetItem(offsets, key, offset)
                                              : PyObject_SetItem(offsets, key, offset);
    Py_XDECREF(offsets);
    Py_DECREF(key);
    Py_DECREF(offset);
    if (stored < 0) {
        return -1;
    }

    /* by_topic[topic] += 1 (a plain int counted as one, a missing topic got as [] gets it) */
    PyObject *count = PyDict_GetItemWithError(self->by_topic, topic); /* borrowed */
    if (count != NULL) {
        Py_INCREF(count);
    }
    else if (PyErr_Occurred() || (count = PyObject_GetItem(self->by_topic, topic)) == NULL) {
        return -1;
    }
    PyObject *counted = NULL;
    int overflow = 1;
    long plain = PyLong_CheckExact(count) ? PyLong_AsLongAndOverflow(count, &overflow) : 0;
    if (!overflow && plain < LONG_MAX) {
        counted = PyLong_FromLong(plain + 1);
    }
    else {
        PyObject *one = PyLong_FromLong(1);
        counted = PyNumber_InPlaceAdd(count, one);
        Py_DECREF(one);
    }
    Py_DECREF(count);
    if (counted == NULL) {
        return -1;
    }
    stored = self->plain_dict ? PyDict_SetItem(self->by_topic, topic, counted)
                              : PyObject_SetItem(self->by_topic, topic, counted);
    Py_DECREF(counted);
    if (stored < 0) {
        return -1;
    }

    /* txn.acknowledged(): txn._pending -= 1, the deliveries still awaited */
    Py_ssize_t pending;
    if (slot_count(txn, self->at[PENDING], slot_names[PENDING], &pending) < 0) {
        return -1;
    }
    PyObject *remaining = PyLong_FromSsize_t(pending - 1);
    if (remaining == NULL) {
        return -1;
    }
    replace_slot(txn, self->at[PENDING], remaining);
    Py_ssize_t unobserved;
    if (slot_count(txn, self->at[UNOBSERVED], slot_names[UNOBSERVED], &unobserved) < 0) {
        return -1;
    }
    if (pending - 1 != 0) {
        PyObject *more = PyLong_FromSsize_t(unobserved + 1);
        if (more == NULL) {
            return -1;
        }
        replace_slot(txn, self->at[UNOBSERVED], more);
        return 0;
    }
    /* observe(now() - txn.commit_time, txn.unobserved + 1); txn.unobserved = 0 */
    PyObject *now = PyObject_CallNoArgs(self->now);
    if (now == NULL) {
        return -1;
    }
    PyObject *commit_time = slot_value(txn, self->at[COMMIT_TIME], slot_names[COMMIT_TIME]);
    PyObject *latency = commit_time == NULL ? NULL : PyNumber_Subtract(now, commit_time);
    Py_XDECREF(commit_time);
    Py_DECREF(now);
    if (latency == NULL) {
        return -1;
    }
    PyObject *events = PyLong_FromSsize_t(unobserved + 1);
    if (events == NULL) {
        Py_DECREF(latency);
        return -1;
    }
    PyObject *observe_args[2] = {latency, events};
    PyObject *observed = PyObject_Vectorcall(self->observe, observe_args, 2, NULL);
    Py_DECREF(events);
    Py_DECREF(latency);
    if (observed == NULL) {
        return -1;
    }
    Py_DECREF(observed);
    replace_slot(txn, self->at[UNOBSERVED], PyLong_FromLong(0)); /* a small int: never NULL */
    return 0;
}

/* An ordinary success: the record a (transaction, table, topic, headers) tuple, the
 * transaction of the known type with every slot set, its counts plain ints (no overflow in
 * reach), its offsets a dict, no error. */
static int
ordinary(Deliveries *self, PyObject *const *args)
{
    PyObject *record = args[0];
    if (args[1] != Py_None || !PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 4) {
        return 0;
    }
    PyObject *txn = PyTuple_GET_ITEM(record, 0);
    if ((PyObject *)Py_TYPE(txn) != self->txn_type || !PyUnicode_CheckExact(PyTuple_GET_ITEM(record, 2))) {
        return 0;
    }
    for (int i = 0; i < SLOTS; i++) {
        if (*(PyObject **)((char *)txn + self->at[i]) == NULL) {
            return 0;
        }
    }
    PyObject *pending = *(PyObject **)((char *)txn + self->at[PENDING]);
    PyObject *unobserved = *(PyObject **)((char *)txn + self->at[UNOBSERVED]);
    if (!PyLong_CheckExact(pending) || !PyLong_CheckExact(unobserved)
        || !PyDict_CheckExact(*(PyObject **)((char *)txn + self->at[OFFSETS]))) {
        return 0;
    }
    int overflow;
    long p = PyLong_AsLongAndOverflow(pending, &overflow);
    if (overflow || p <= LONG_MIN + 1) {
        return 0;
    }
    long u = PyLong_AsLongAndOverflow(unobserved, &overflow);
    return !overflow && u < LONG_MAX - 1;
}

static PyObject *
deliveries_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Deliveries *self = (Deliveries *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || kwnames != NULL || !ordinary(self, args)) {
        return PyObject_Vectorcall(self->reference, args, nargsf, kwnames);
    }
    PyObject *record = args[0];
    if (delivered(self, PyTuple_GET_ITEM(record, 0), PyTuple_GET_ITEM(record, 2), args[2]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
deliveries_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *txn_type, *by_topic, *observe, *now, *reference;
    static char *keywords[] = {"txn_type", "by_topic", "observe", "now", "reference", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOO:Deliveries", keywords,
                                     &PyType_Type, &txn_type, &PyDict_Type, &by_topic, &observe,
                                     &now, &reference)) {
        return NULL;
    }
    if (!PyCallable_Check(observe) || !PyCallable_Check(now) || !PyCallable_Check(reference)) {
        PyErr_SetString(PyExc_TypeError, "Deliveries: observe, now and reference must be callable");
        return NULL;
    }
    Py_ssize_t at[SLOTS];
    for (int i = 0; i < SLOTS; i++) {
        at[i] = slot_offset((PyTypeObject *)txn_type, slot_names[i]);
        if (at[i] < 0) {
            PyErr_Format(PyExc_TypeError, "Deliveries: %R has no slot %s", txn_type,
                         slot_names[i]);
            return NULL;
        }
    }
    Deliveries *self = (Deliveries *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = deliveries_call;
    self->txn_type = Py_NewRef(txn_type);
    memcpy(self->at, at, sizeof(at));
    self->by_topic = Py_NewRef(by_topic);
    self->plain_dict = Py_TYPE(by_topic)->tp_as_mapping != NULL
                       && Py_TYPE(by_topic)->tp_as_mapping->mp_ass_subscript
                              == PyDict_Type.tp_as_mapping->mp_ass_subscript;
    self->observe = Py_NewRef(observe);
    self->now = Py_NewRef(now);
    self->reference = Py_NewRef(reference);
    return (PyObject *)self;
}

static int
deliveries_traverse(Deliveries *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->txn_type);
    Py_VISIT(self->by_topic);
    Py_VISIT(self->observe);
    Py_VISIT(self->now);
    Py_VISIT(self->reference);
    Py_VISIT(self->msg_type);
    Py_VISIT(self->partition_of);
    Py_VISIT(self->offset_of);
    return 0;
}

static int
deliveries_clear(Deliveries *self)
{
    Py_CLEAR(self->txn_type);
    Py_CLEAR(self->by_topic);
    Py_CLEAR(self->observe);
    Py_CLEAR(self->now);
    Py_CLEAR(self->reference);
    Py_CLEAR(self->msg_type);
    Py_CLEAR(self->partition_of);
    Py_CLEAR(self->offset_of);
    return 0;
}

static void
deliveries_dealloc(Deliveries *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    deliveries_clear(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyMemberDef deliveries_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Deliveries, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot deliveries_slots[] = {
    {Py_tp_doc, "Deliveries(txn_type, by_topic, observe, now, reference): a delivery callback, "
                "called as (record, err, msg); reference is what it does, in Python."},
    {Py_tp_new, deliveries_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, deliveries_traverse},
    {Py_tp_clear, deliveries_clear},
    {Py_tp_dealloc, deliveries_dealloc},
    {Py_tp_members, deliveries_members},
    {0, NULL},
};

static PyType_Spec deliveries_spec = {
    .name = "cdc_relay.decode._tuple_reader.Deliveries",
    .basicsize = sizeof(Deliveries),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
             | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = deliveries_slots,
};

/* Publisher: see the top of the file. */
enum { EVENTS, TXN_PENDING, POSITION, TXN_SLOTS };
static const char *const txn_slot_names[TXN_SLOTS] = {"events", "_pending", "position"};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *txn_type;         /* the transactions' exact type, whose slots are read */
    Py_ssize_t at[TXN_SLOTS];   /* where its instances hold each slot */
    PyObject *decoder;          /* the PgOutputDecoder, whose slot says whether in a stream */
    Py_ssize_t in_stream_at;
    Py_ssize_t offset;          /* where a frame's pgoutput message starts */
    PyObject *fast_states;      /* a dict: relation id -> (spec, topics, last, table) */
    PyObject *unchanged;        /* what a column of kind 'u' reads as */
    PyObject *known_topics;     /* a set */
    PyObject *produce;
    PyObject *produce_failed;   /* Session.produce_failed: a produce that raised an Exception */
    PyObject *callback;
    PyObject *position_header;  /* str */
    PyObject *any_partition;
    PyObject *no_timestamp;
    unsigned long relation;     /* the last Insert's relation id, and that id as an int */
    PyObject *relation_id;
} Publisher;

/* *value = the int in slot `at` of obj when it is an exact int in [0, PY_SSIZE_T_MAX - 1), else
 * 0 (no exception set). 1 when found. */
static int
plain_count(PyObject *obj, Py_ssize_t at, Py_ssize_t *value)
{
    PyObject *count = *(PyObject **)((char *)obj + at);
    if (count == NULL || !PyLong_CheckExact(count)) {
        return 0;
    }
    int overflow;
    long plain = PyLong_AsLongAndOverflow(count, &overflow);
    if (overflow || plain < 0 || plain >= PY_SSIZE_T_MAX - 1) {
        return 0;
    }
    *value = (Py_ssize_t)plain;
    return 1;
}

/* txn.position + b"%d" % ordinal, prefix an exact bytes object, ordinal positive. */
static PyObject *
event_position(PyObject *prefix, Py_ssize_t ordinal)
{
    char digits[24];
    int length = 0;
    for (Py_ssize_t rest = ordinal; rest > 0; rest /= 10) {
        digits[sizeof(digits) - 1 - length++] = (char)('0' + rest % 10);
    }
    Py_ssize_t size = PyBytes_GET_SIZE(prefix);
    PyObject *position = PyBytes_FromStringAndSize(NULL, size + length);
    if (position == NULL) {
        return NULL;
    }
    memcpy(PyBytes_AS_STRING(position), PyBytes_AS_STRING(prefix), (size_t)size);
    memcpy(PyBytes_AS_STRING(position) + size, digits + sizeof(digits) - length, (size_t)length);
    return position;
}

/* Publish the row with its relation's fast state: Py_True once produced, Py_False (nothing
 * changed) for anything the caller's Python must do, NULL with an exception. txn is of the
 * exact type. */
static PyObject *
publish_row(Publisher *self, PyObject *state, PyObject *row, PyObject *txn)
{
    if (!PyTuple_CheckExact(state) || PyTuple_GET_SIZE(state) != 4) {
        Py_RETURN_FALSE;
    }
    PyObject *spec = PyTuple_GET_ITEM(state, 0), *topics = PyTuple_GET_ITEM(state, 1);
    PyObject *last = PyTuple_GET_ITEM(state, 2), *table = PyTuple_GET_ITEM(state, 3);
    if (!PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) != SPEC_SIZE
        || !PyDict_CheckExact(topics) || !PyList_CheckExact(last) || PyList_GET_SIZE(last) != 3
        || !PyUnicode_CheckExact(table)) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t events, pending;
    PyObject *prefix = *(PyObject **)((char *)txn + self->at[POSITION]);
    if (!plain_count(txn, self->at[EVENTS], &events)
        || !plain_count(txn, self->at[TXN_PENDING], &pending) || prefix == NULL
        || !PyBytes_CheckExact(prefix)) {
        Py_RETURN_FALSE;
    }
    PlainRow plain;
    int found = plain_columns(row, spec, topics, last, &plain);
    if (found <= 0) {
        return found < 0 ? NULL : Py_NewRef(Py_False);
    }
    /* record_fields' check of the id, without keeping its text (only a failure needs it) */
    const unsigned char *id = (const unsigned char *)PyBytes_AS_STRING(plain.raw_id);
    Py_ssize_t id_size = PyBytes_GET_SIZE(plain.raw_id), ascii = 0;
    while (ascii < id_size && id[ascii] < 0x80) {
        ascii++;
    }
    if (ascii < id_size) {
        PyObject *text = utf8_text(plain.raw_id);
        if (text == NULL) {
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
        }
        Py_DECREF(text);
    }
    int known = PySet_Contains(self->known_topics, plain.topic);
    if (known <= 0) {
        return known < 0 ? NULL : Py_NewRef(Py_False);
    }
    /* Everything checked: from here on it publishes. */
    PyObject *topic = Py_NewRef(plain.topic); /* `last` could change while Python code runs */
    PyObject *key = plain.aggregate_id, *value = plain.payload; /* the caller holds the row */
    PyObject *bound = NULL, *on_delivery = NULL, *result = NULL;
    PyObject *headers = first_headers(spec, &plain, 1);
    PyObject *ordinal = PyLong_FromSsize_t(events + 1);
    PyObject *position = event_position(prefix, events + 1);
    if (headers == NULL || ordinal == NULL || position == NULL) {
        Py_XDECREF(ordinal);
        Py_XDECREF(position);
        goto done;
    }
    PyObject *header = PyTuple_New(2);
    if (header == NULL) {
        Py_DECREF(ordinal);
        Py_DECREF(position);
        goto done;
    }
    PyTuple_SET_ITEM(header, 0, Py_NewRef(self->position_header));
    PyTuple_SET_ITEM(header, 1, position);
    PyList_SET_ITEM(headers, 3, header);
    bound = PyTuple_Pack(4, txn, table, topic, headers);
    if (bound == NULL || (on_delivery = PyMethod_New(self->callback, bound)) == NULL) {
        Py_DECREF(ordinal);
        goto done;
    }
    /* txn.events += 1 before producing, as publish does it */
    replace_slot(txn, self->at[EVENTS], ordinal);
    PyObject *args[8] = {topic, value, key, self->any_partition, on_delivery, Py_None,
                         self->no_timestamp, headers};
    PyObject *produced = PyObject_Vectorcall(self->produce, args, 8, NULL);
    if (produced == NULL) {
        /* a full queue, or librdkafka's refusal: publish's handler from here, as publish calls
         * it (anything that is no Exception propagates, as from publish) */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            goto done;
        }
        PyObject *type, *error, *traceback;
        PyErr_Fetch(&type, &error, &traceback);
        PyErr_NormalizeException(&type, &error, &traceback);
        if (traceback != NULL) {
            PyException_SetTraceback(error, traceback);
        }
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        PyObject *event_id = utf8_text(plain.raw_id); /* UTF-8: checked above */
        if (event_id == NULL) {
            Py_DECREF(error);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_SystemError, "Publisher: the event id changed");
            }
            goto done;
        }
        PyObject *failed_args[9] = {error, txn, table, topic, key, value, headers, event_id,
                                    on_delivery};
        PyObject *handled = PyObject_Vectorcall(self->produce_failed, failed_args, 9, NULL);
        Py_DECREF(event_id);
        Py_DECREF(error);
        if (handled != NULL) {
            Py_DECREF(handled);
            result = Py_NewRef(Py_True);
        }
        goto done;
    }
    Py_DECREF(produced);
    /* txn.produced(): _pending += 1, on the slot while it holds a plain count */
    if (plain_count(txn, self->at[TXN_PENDING], &pending)) {
        PyObject *more = PyLong_FromSsize_t(pending + 1);
        if (more == NULL) {
            goto done;
        }
        replace_slot(txn, self->at[TXN_PENDING], more);
    }
    else {
        PyObject *done = PyObject_CallMethod(txn, "produced", NULL);
        if (done == NULL) {
            goto done;
        }
        Py_DECREF(done);
    }
    result = Py_NewRef(Py_True);

done:
    Py_DECREF(topic);
    Py_XDECREF(headers);
    Py_XDECREF(bound);
    Py_XDECREF(on_delivery);
    return result;
}

/* The Insert at frame[offset:], when it is one of a relation with a fast state: its row (a new
 * tuple) and *state (borrowed). NULL, no exception set, for anything else (another message, a
 * malformed one: the decoder reads it and names what is wrong). */
static PyObject *
insert_row(Publisher *self, PyObject *frame, PyObject **state)
{
    Py_buffer view;
    if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not a frame: the decoder says so */
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)view.buf;
    Py_ssize_t size = view.len, offset = self->offset;
    PyObject *row = NULL;
    /* 'I', Int32 relation id, 'N', TupleData: as read_message reads an Insert */
    if (offset < 0 || size - offset < 6 || data[offset] != 'I' || data[offset + 5] != 'N') {
        goto done;
    }
    unsigned long relation = be32(data + offset + 1);
    if (self->relation_id == NULL || relation != self->relation) {
        /* the last relation id's int, kept: consecutive inserts are mostly of one table */
        PyObject *relation_id = PyLong_FromUnsignedLong(relation);
        if (relation_id == NULL) {
            goto done;
        }
        Py_XSETREF(self->relation_id, relation_id);
        self->relation = relation;
    }
    *state = PyDict_GetItemWithError(self->fast_states, self->relation_id);
    if (*state == NULL) {
        goto done;
    }
    Py_ssize_t pos = offset + 6;
    row = read_values(data, size, &pos, self->unchanged);

done:
    PyBuffer_Release(&view);
    return row;
}

static PyObject *
publisher_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Publisher *self = (Publisher *)callable;
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "Publisher(frame, txn) takes 2 arguments");
        return NULL;
    }
    PyObject *txn = args[1];
    if ((PyObject *)Py_TYPE(txn) != self->txn_type
        || *(PyObject **)((char *)self->decoder + self->in_stream_at) != Py_False) {
        Py_RETURN_FALSE;
    }
    PyObject *state = NULL;
    PyObject *row = insert_row(self, args[0], &state);
    if (row == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_FALSE;
    }
    PyObject *published = publish_row(self, state, row, txn);
    Py_DECREF(row);
    return published;
}

static PyObject *
publisher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *decoder, *txn_type, *fast_states, *known_topics, *produce, *produce_failed;
    PyObject *callback, *position_header, *unchanged;
    Py_ssize_t offset;
    static char *keywords[] = {"decoder", "offset", "txn_type", "fast_states", "known_topics",
                               "produce", "produce_failed", "callback", "position_header",
                               "unchanged", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnO!OOOOOUO:Publisher", keywords, &decoder,
                                     &offset, &PyType_Type, &txn_type, &fast_states,
                                     &known_topics, &produce, &produce_failed, &callback,
                                     &position_header, &unchanged)) {
        return NULL;
    }
    if (offset < 0 || !PyDict_CheckExact(fast_states) || !PySet_CheckExact(known_topics)
        || !PyCallable_Check(produce) || !PyCallable_Check(produce_failed)
        || !PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError,
                        "Publisher: offset must be >= 0, fast_states a dict, known_topics a set, "
                        "produce, produce_failed and callback callable");
        return NULL;
    }
    Py_ssize_t in_stream_at = slot_offset(Py_TYPE(decoder), "_in_stream");
    if (in_stream_at < 0) {
        PyErr_Format(PyExc_TypeError, "Publisher: %R has no slot _in_stream", Py_TYPE(decoder));
        return NULL;
    }
    Py_ssize_t at[TXN_SLOTS];
    for (int i = 0; i < TXN_SLOTS; i++) {
        at[i] = slot_offset((PyTypeObject *)txn_type, txn_slot_names[i]);
        if (at[i] < 0) {
            PyErr_Format(PyExc_TypeError, "Publisher: %R has no slot %s", txn_type,
                         txn_slot_names[i]);
            return NULL;
        }
    }
    Publisher *self = (Publisher *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = publisher_call;
    self->txn_type = Py_NewRef(txn_type);
    memcpy(self->at, at, sizeof(at));
    self->decoder = Py_NewRef(decoder);
    self->in_stream_at = in_stream_at;
    self->offset = offset;
    self->fast_states = Py_NewRef(fast_states);
    self->unchanged = Py_NewRef(unchanged);
    self->known_topics = Py_NewRef(known_topics);
    self->produce = Py_NewRef(produce);
    self->produce_failed = Py_NewRef(produce_failed);
    self->callback = Py_NewRef(callback);
    self->position_header = Py_NewRef(position_header);
    self->any_partition = PyLong_FromLong(-1); /* small ints: never NULL */
    self->no_timestamp = PyLong_FromLong(0);
    return (PyObject *)self;
}

static int
publisher_traverse(Publisher *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->txn_type);
    Py_VISIT(self->decoder);
    Py_VISIT(self->unchanged);
    Py_VISIT(self->fast_states);
    Py_VISIT(self->known_topics);
    Py_VISIT(self->produce);
    Py_VISIT(self->produce_failed);
    Py_VISIT(self->callback);
    Py_VISIT(self->position_header);
    return 0;
}

static int
publisher_clear(Publisher *self)
{
    Py_CLEAR(self->txn_type);
    Py_CLEAR(self->decoder);
    Py_CLEAR(self->unchanged);
    Py_CLEAR(self->fast_states);
    Py_CLEAR(self->known_topics);
    Py_CLEAR(self->produce);
    Py_CLEAR(self->produce_failed);
    Py_CLEAR(self->callback);
    Py_CLEAR(self->position_header);
    Py_CLEAR(self->any_partition);
    Py_CLEAR(self->no_timestamp);
    Py_CLEAR(self->relation_id);
    return 0;
}

static void
publisher_dealloc(Publisher *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    publisher_clear(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyMemberDef publisher_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Publisher, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot publisher_slots[] = {
    {Py_tp_doc, "Publisher(decoder, offset, txn_type, fast_states, known_topics, produce, "
                "produce_failed, callback, position_header, unchanged): decodes and publishes "
                "an Insert's "
                "ordinary row, called as (frame, txn); False: do it in Python."},
    {Py_tp_new, publisher_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, publisher_traverse},
    {Py_tp_clear, publisher_clear},
    {Py_tp_dealloc, publisher_dealloc},
    {Py_tp_members, publisher_members},
    {0, NULL},
};

static PyType_Spec publisher_spec = {
    .name = "cdc_relay.decode._tuple_reader.Publisher",
    .basicsize = sizeof(Publisher),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
             | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = publisher_slots,
};

typedef struct {
    PyObject *deliveries_type;
    PyObject *publisher_type;
} ModuleState;

static int
module_exec(PyObject *module)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    state->deliveries_type = PyType_FromModuleAndSpec(module, &deliveries_spec, NULL);
    if (state->deliveries_type == NULL) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "Deliveries", state->deliveries_type) < 0) {
        return -1;
    }
    state->publisher_type = PyType_FromModuleAndSpec(module, &publisher_spec, NULL);
    if (state->publisher_type == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "Publisher", state->publisher_type);
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    if (state != NULL) {
        Py_VISIT(state->deliveries_type);
        Py_VISIT(state->publisher_type);
    }
    return 0;
}

static int
module_clear(PyObject *module)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    if (state != NULL) {
        Py_CLEAR(state->deliveries_type);
        Py_CLEAR(state->publisher_type);
    }
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyMethodDef methods[] = {
    {"record_fields", (PyCFunction)(void (*)(void))record_fields, METH_FASTCALL,
     "record_fields(spec, topics, last, reference, row) -> tuple | None: the plain outbox "
     "mapping of an ordinary row."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(function, obj) -> method: types.MethodType(function, obj), cheaper."},
    {"read_tuple", (PyCFunction)(void (*)(void))read_tuple, METH_FASTCALL,
     "read_tuple(buf, pos, unchanged) -> (values, end) | None: one pgoutput TupleData."},
    {"read_message", (PyCFunction)(void (*)(void))read_message, METH_FASTCALL,
     "read_message(frame, offset, insert_type, begin_type, commit_type, unchanged) -> "
     "Insert | Begin | Commit | None: one pgoutput message of those kinds."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdc_relay.decode._tuple_reader",
    .m_doc = "One pgoutput TupleData, or Insert, Begin or Commit, read in one call (pgoutput.py "
              "is the reference).",
    .m_size = sizeof(ModuleState),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__tuple_reader(void)
{
    return PyModuleDef_Init(&module);
}
