//! Instances of a msgspec `Struct` type built by writing their field slots: the fields a call
//! gives, and for every other field the default the type's own constructor stores there. That is
//! what msgspec's constructor does (allocate the object, fill one slot per field) without its
//! per-call handling of arguments and defaults; a decode step builds one vLLM
//! `EngineCoreOutput` (19 fields) per request.
//!
//! Nothing about the layout is assumed. It is read once, from the type itself: the type is
//! called with a distinct marker object in every field, and each field's slot is where its
//! marker lies. The direct path is used only when that finds exactly one pointer-sized slot per
//! field and nothing else in the object, the type is not tracked by the cyclic collector (msgspec's
//! `gc=False`), it has no `__post_init__`, and every default is an immutable atomic value (so
//! sharing one object between instances is what the constructor does too). Otherwise every
//! build calls the type.

use std::mem::size_of;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::named_fields::NamedFields;
use crate::refcount;

/// Builds instances of one msgspec `Struct` type.
pub struct StructBuilder {
    ty: Py<PyAny>,
    /// Field names, in the type's order (`__struct_fields__`).
    fields: NamedFields,
    /// Set when the direct path applies.
    slots: Option<Slots>,
}

/// How the direct path fills an instance.
struct Slots {
    alloc: Alloc,
    /// Slot index (0 = the first pointer after the object header) of each field, in field
    /// order.
    slot_of: Vec<usize>,
    /// What a new instance's slots hold before the given fields go in: each field's default,
    /// None (NULL) for the first `required` fields, which every build gives.
    template: Vec<Option<Py<PyAny>>>,
    required: usize,
}

/// How instances are allocated.
#[derive(Clone, Copy)]
enum Alloc {
    /// The type allocates with CPython's generic allocator and frees with `PyObject_Free`: an
    /// instance is `PyObject_Malloc` + `PyObject_Init`, as that allocator does without the
    /// zeroing (every slot is written).
    Object { size: usize },
    /// Any other `tp_alloc`, called.
    Slot(ffi::allocfunc),
}

impl StructBuilder {
    /// A builder for the msgspec `Struct` type `ty`.
    pub fn new(ty: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = ty.py();
        let names: Vec<Py<PyString>> = ty
            .getattr(intern!(py, "__struct_fields__"))?
            .cast_into::<PyTuple>()?
            .iter()
            .map(|n| n.cast_into::<PyString>().map(Bound::unbind))
            .collect::<Result<_, _>>()?;
        let fields = NamedFields::new(names);
        let slots = read_slots(ty, &fields)?;
        Ok(Self {
            ty: ty.clone().unbind(),
            fields,
            slots,
        })
    }

    /// The index of the field `name`.
    pub fn field(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.fields.index(py, name)
    }

    /// The struct type.
    pub fn type_object(&self) -> &Py<PyAny> {
        &self.ty
    }

    /// Whether builds fill the slots directly (else they call the type).
    pub fn is_direct(&self) -> bool {
        self.slots.is_some()
    }

    /// A new instance with the `given` fields (`(field index, value)`, each field at most once,
    /// their references moved into it) and every other field at its default.
    pub fn build<'py, const N: usize>(
        &self,
        py: Python<'py>,
        given: [(usize, Bound<'py, PyAny>); N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(slots) = self
            .slots
            .as_ref()
            .filter(|slots| (0..slots.required).all(|i| given.iter().any(|(j, _)| *j == i)))
        else {
            // Another layout, or a required field missing (the type raises its TypeError).
            let borrowed: Vec<(usize, &Bound<'py, PyAny>)> =
                given.iter().map(|(i, v)| (*i, v)).collect();
            return self.call(py, &borrowed);
        };
        let obj = slots.alloc(self.ty.as_ptr().cast());
        if obj.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: the slots follow the object header, one pointer each (checked in
        // `read_slots`), inside the `basicsize` bytes just allocated.
        let fields = unsafe {
            std::slice::from_raw_parts_mut(
                obj.cast::<u8>()
                    .add(size_of::<ffi::PyObject>())
                    .cast::<*mut ffi::PyObject>(),
                slots.template.len(),
            )
        };
        // Each slot holds a reference of its own, which the type's dealloc releases as it does
        // for every instance: a new one to its default, or the given value's, moved in.
        for (field, default) in fields.iter_mut().zip(&slots.template) {
            let default = default.as_ref().map_or(std::ptr::null_mut(), Py::as_ptr);
            // SAFETY: `default` is NULL or alive (held by the template).
            unsafe { refcount::xincref(default) };
            *field = default;
        }
        for (i, value) in given {
            let old = std::mem::replace(&mut fields[slots.slot_of[i]], value.into_ptr());
            // SAFETY: a replaced default stays alive, held by the template.
            unsafe { refcount::xdecref(old) };
        }
        // SAFETY: `obj` is a new reference to an instance whose every field slot is set.
        Ok(unsafe { Bound::from_owned_ptr(py, obj) })
    }

    /// The constructor call: `ty(**given)`.
    fn call<'py>(
        &self,
        py: Python<'py>,
        given: &[(usize, &Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        self.fields.call(self.ty.bind(py), given)
    }
}

impl Slots {
    /// A new instance of `ty`, its slots unset (NULL or garbage), or NULL with an exception set.
    fn alloc(&self, ty: *mut ffi::PyTypeObject) -> *mut ffi::PyObject {
        match self.alloc {
            // SAFETY: `size` is the type's `basicsize`; `PyObject_Init` sets the header (type,
            // with a reference to it for a heap type, and a reference count of one), as the
            // generic allocator does.
            Alloc::Object { size } => unsafe {
                let obj = ffi::PyObject_Malloc(size).cast::<ffi::PyObject>();
                if obj.is_null() {
                    return ffi::PyErr_NoMemory();
                }
                ffi::PyObject_Init(obj, ty)
            },
            // SAFETY: the type's own allocator.
            Alloc::Slot(alloc) => unsafe { alloc(ty, 0) },
        }
    }
}

/// The slots of `ty`'s fields and their defaults, when the direct path applies (see the module
/// doc), else None.
fn read_slots(ty: &Bound<'_, PyAny>, fields: &NamedFields) -> PyResult<Option<Slots>> {
    let py = ty.py();
    let names = fields.names();
    let Ok(ty_obj) = ty.cast::<pyo3::types::PyType>() else {
        return Ok(None);
    };
    let ty_ptr = ty_obj.as_type_ptr();
    // SAFETY: `ty_ptr` is a live type object.
    let flags = unsafe { ffi::PyType_GetFlags(ty_ptr) };
    if flags & ffi::Py_TPFLAGS_HAVE_GC != 0 || ty.hasattr(intern!(py, "__post_init__"))? {
        return Ok(None);
    }
    let basicsize: usize = ty.getattr(intern!(py, "__basicsize__"))?.extract()?;
    let (header, width) = (size_of::<ffi::PyObject>(), size_of::<*mut ffi::PyObject>());
    if basicsize != header + names.len() * width {
        return Ok(None);
    }
    let Some(alloc) = allocator(ty_ptr, basicsize) else {
        return Ok(None);
    };

    // Every field given a marker of its own: each marker's slot is its field's.
    let markers: Vec<Bound<'_, PyAny>> =
        names.iter().map(|_| PyList::empty(py).into_any()).collect();
    let given: Vec<(usize, &Bound<'_, PyAny>)> = markers.iter().enumerate().collect();
    let probe = fields.call(ty, &given)?;
    let probed = slot_values(&probe, names.len());
    let mut slot_of = Vec::with_capacity(names.len());
    for marker in &markers {
        let mut found = (0..probed.len()).filter(|&k| probed[k] == marker.as_ptr());
        match (found.next(), found.next()) {
            (Some(k), None) => slot_of.push(k),
            _ => return Ok(None),
        }
    }

    // The defaults: what the constructor stores in the fields it is not given.
    let required = names.len() - ty.getattr(intern!(py, "__struct_defaults__"))?.len()?;
    let prototype = fields.call(ty, &given[..required])?;
    let stored = slot_values(&prototype, names.len());
    let mut template: Vec<Option<Py<PyAny>>> = (0..names.len()).map(|_| None).collect();
    for (i, &k) in slot_of.iter().enumerate() {
        if i < required {
            if stored[k] != markers[i].as_ptr() {
                return Ok(None);
            }
            continue;
        }
        // SAFETY: the prototype holds a reference to every field value it stores.
        match unsafe { Bound::from_borrowed_ptr_or_opt(py, stored[k]) } {
            Some(v) if is_immutable_atom(&v) => template[k] = Some(v.unbind()),
            _ => return Ok(None),
        }
    }
    Ok(Some(Slots {
        alloc,
        slot_of,
        template,
        required,
    }))
}

/// How to allocate instances of `ty` (`basicsize` bytes), or None if it has no `tp_alloc`.
fn allocator(ty: *mut ffi::PyTypeObject, basicsize: usize) -> Option<Alloc> {
    // SAFETY: a heap type (msgspec's struct types are) answers `PyType_GetSlot`; the slots hold
    // an `allocfunc` and a `freefunc`.
    unsafe {
        let alloc = ffi::PyType_GetSlot(ty, ffi::Py_tp_alloc);
        let free = ffi::PyType_GetSlot(ty, ffi::Py_tp_free);
        if alloc.is_null() {
            return None;
        }
        let generic = ffi::PyType_GenericAlloc as ffi::allocfunc as *mut std::ffi::c_void;
        let object_free = ffi::PyObject_Free as ffi::freefunc as *mut std::ffi::c_void;
        Some(if alloc == generic && free == object_free {
            Alloc::Object { size: basicsize }
        } else {
            Alloc::Slot(std::mem::transmute::<*mut std::ffi::c_void, ffi::allocfunc>(alloc))
        })
    }
}

/// The pointers in the first `n` slots of `obj`.
fn slot_values(obj: &Bound<'_, PyAny>, n: usize) -> Vec<*mut ffi::PyObject> {
    let base = obj.as_ptr().cast::<u8>();
    (0..n)
        .map(|k| {
            // SAFETY: `obj` is an instance of a type whose `basicsize` holds `n` slots after the
            // header (checked by the caller); the slots are pointer-aligned.
            unsafe {
                *base
                    .add(size_of::<ffi::PyObject>() + k * size_of::<*mut ffi::PyObject>())
                    .cast::<*mut ffi::PyObject>()
            }
        })
        .collect()
}

/// Whether `v` is None or an exact bool, int, float, str or bytes: a value every instance may
/// share.
fn is_immutable_atom(v: &Bound<'_, PyAny>) -> bool {
    v.is_none()
        || v.is_exact_instance_of::<PyBool>()
        || v.is_exact_instance_of::<PyInt>()
        || v.is_exact_instance_of::<PyFloat>()
        || v.is_exact_instance_of::<PyString>()
        || v.is_exact_instance_of::<PyBytes>()
}
