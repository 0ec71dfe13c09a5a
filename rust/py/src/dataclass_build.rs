//! Instances of a plain Python dataclass built from Rust without running its generated
//! `__init__`: the instance is allocated as `object.__new__` allocates it and gets, as its
//! `__dict__`, a copy of a template dict that holds every field in field order at its default;
//! the fields given and those with a `default_factory` (called each build) are then replaced.
//! Copying a dict clones its table in one go, where setting each field as the `__init__` does
//! (`object.__setattr__`) grows the instance dict one attribute at a time. The vLLM drop-in
//! builds five such objects a step (`SchedulerOutput`, `CachedRequestData`, `SchedulerStats`,
//! `PrefixCacheStats`, `SpecDecodingStats`).
//!
//! The shortcut is checked, not assumed: it is taken only for a dataclass whose `__new__` is
//! `object.__new__`, which has no `__post_init__` and whose fields are all `init` fields, and
//! only after one instance built each way from the same arguments had the same attributes.
//! Otherwise every build calls the class.

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyDictMethods, PyList, PyString, PyTuple, PyType};

use crate::named_fields::NamedFields;

/// Where a field's value comes from when a build does not give it.
enum FieldDefault {
    Value(Py<PyAny>),
    Factory(Py<PyAny>),
    /// `default_factory=dict` or `list`: a new empty one, made without calling the type.
    EmptyDict,
    EmptyList,
    /// No default: every build gives it.
    Required,
}

/// Builds instances of one dataclass.
pub struct DataclassBuilder {
    cls: Py<PyType>,
    fields: NamedFields,
    defaults: Vec<FieldDefault>,
    /// Every field in field order, at its default (None where it has none, or a factory).
    template: Py<PyDict>,
    /// Whether builds set the fields directly (else they call the class).
    direct: bool,
}

impl DataclassBuilder {
    /// A builder for the dataclass `cls`; `example` is a call that is valid for it (`(field
    /// name, value)` pairs), used to check the direct build against the class's own.
    pub fn new(cls: &Bound<'_, PyType>, example: &[(&str, Bound<'_, PyAny>)]) -> PyResult<Self> {
        let py = cls.py();
        let dataclasses = py.import(intern!(py, "dataclasses"))?;
        let missing = dataclasses.getattr(intern!(py, "MISSING"))?;
        let mut names = Vec::new();
        let mut defaults = Vec::new();
        let mut all_init = true;
        for field in dataclasses
            .call_method1(intern!(py, "fields"), (cls,))?
            .try_iter()?
        {
            let field = field?;
            all_init &= field.getattr(intern!(py, "init"))?.is_truthy()?;
            names.push(
                field
                    .getattr(intern!(py, "name"))?
                    .cast_into::<PyString>()?
                    .unbind(),
            );
            let default = field.getattr(intern!(py, "default"))?;
            let factory = field.getattr(intern!(py, "default_factory"))?;
            defaults.push(if !default.is(&missing) {
                FieldDefault::Value(default.unbind())
            } else if factory.is(py.get_type::<PyDict>()) {
                FieldDefault::EmptyDict
            } else if factory.is(py.get_type::<PyList>()) {
                FieldDefault::EmptyList
            } else if !factory.is(&missing) {
                FieldDefault::Factory(factory.unbind())
            } else {
                FieldDefault::Required
            });
        }
        let object_new = py
            .get_type::<pyo3::types::PyAny>()
            .getattr(intern!(py, "__new__"))?;
        let plain = all_init
            && cls.getattr(intern!(py, "__new__"))?.is(&object_new)
            && !cls.hasattr(intern!(py, "__post_init__"))?;
        let template = PyDict::new(py);
        for (name, default) in names.iter().zip(&defaults) {
            match default {
                FieldDefault::Value(v) => template.set_item(name, v)?,
                _ => template.set_item(name, py.None())?,
            }
        }
        let mut builder = Self {
            cls: cls.clone().unbind(),
            fields: NamedFields::new(names),
            defaults,
            template: template.unbind(),
            direct: false,
        };
        if plain {
            let given = example
                .iter()
                .map(|(name, value)| Ok((builder.field(py, name)?, value)))
                .collect::<PyResult<Vec<_>>>()?;
            let ours = builder.build_direct(py, &given)?;
            let theirs = builder.call(py, &given)?;
            // A class without instance dicts (slots) is left to its constructor.
            builder.direct = matches!(vars(&ours).and_then(|a| a.eq(vars(&theirs)?)), Ok(true));
        }
        Ok(builder)
    }

    /// The index of the field `name`.
    pub fn field(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.fields.index(py, name)
    }

    /// Whether builds set the fields directly (else they call the class).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The dataclass.
    pub fn class(&self) -> &Py<PyType> {
        &self.cls
    }

    /// A new instance with the `given` fields (`(field index, value)`) and every other field at
    /// its default.
    pub fn build<'py>(
        &self,
        py: Python<'py>,
        given: &[(usize, &Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        if self.direct {
            self.build_direct(py, given)
        } else {
            self.call(py, given)
        }
    }

    fn build_direct<'py>(
        &self,
        py: Python<'py>,
        given: &[(usize, &Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        let cls = self.cls.bind(py);
        // SAFETY: `PyType_GenericNew` allocates an instance with the type's `tp_alloc`, as
        // `object.__new__` does; it returns a new reference or NULL with an exception set.
        let obj = unsafe {
            let empty = PyTuple::empty(py);
            Bound::from_owned_ptr_or_err(
                py,
                ffi::PyType_GenericNew(cls.as_type_ptr(), empty.as_ptr(), std::ptr::null_mut()),
            )?
        };
        let dict = self.template.bind(py).copy()?;
        let names = self.fields.names();
        for (i, value) in given {
            dict.set_item(names[*i].bind(py), *value)?;
        }
        for (i, default) in self.defaults.iter().enumerate() {
            match default {
                FieldDefault::Value(_) => {}
                _ if given.iter().any(|(j, _)| *j == i) => {}
                FieldDefault::Factory(f) => {
                    dict.set_item(names[i].bind(py), f.bind(py).call0()?)?
                }
                FieldDefault::EmptyDict => dict.set_item(names[i].bind(py), PyDict::new(py))?,
                FieldDefault::EmptyList => dict.set_item(names[i].bind(py), PyList::empty(py))?,
                FieldDefault::Required => {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "missing dataclass field {}",
                        names[i].bind(py)
                    )))
                }
            }
        }
        obj.setattr(intern!(py, "__dict__"), dict)?;
        Ok(obj)
    }

    /// The class called with the `given` fields as keywords.
    fn call<'py>(
        &self,
        py: Python<'py>,
        given: &[(usize, &Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        self.fields.call(self.cls.bind(py).as_any(), given)
    }
}

/// `vars(obj)`.
fn vars<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr(intern!(obj.py(), "__dict__"))
}
