//! Instances of a plain Python dataclass built from Rust without running its generated
//! `__init__`: the instance is allocated as `object.__new__` allocates it, then every field is
//! set as that `__init__` sets it (`object.__setattr__`), each from the value given or else the
//! field's default or `default_factory()`. The vLLM drop-in builds three such objects a step
//! (`SchedulerStats`, `PrefixCacheStats`, `SpecDecodingStats`), and running their `__init__`
//! bytecode cost several microseconds a step.
//!
//! The shortcut is checked, not assumed: it is taken only for a dataclass whose `__new__` is
//! `object.__new__`, which has no `__post_init__` and whose fields are all `init` fields, and
//! only after one instance built each way from the same arguments had the same attributes.
//! Otherwise every build calls the class.

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};

use crate::named_fields::NamedFields;

/// Where a field's value comes from when a build does not give it.
enum FieldDefault {
    Value(Py<PyAny>),
    Factory(Py<PyAny>),
    /// No default: every build gives it.
    Required,
}

/// Builds instances of one dataclass.
pub struct DataclassBuilder {
    cls: Py<PyType>,
    fields: NamedFields,
    defaults: Vec<FieldDefault>,
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
        let mut builder = Self {
            cls: cls.clone().unbind(),
            fields: NamedFields::new(names),
            defaults,
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
        for (i, (name, default)) in self.fields.names().iter().zip(&self.defaults).enumerate() {
            let value = match (given.iter().find(|(j, _)| *j == i), default) {
                (Some((_, v)), _) => (*v).clone(),
                (None, FieldDefault::Value(v)) => v.bind(py).clone(),
                (None, FieldDefault::Factory(f)) => f.bind(py).call0()?,
                (None, FieldDefault::Required) => {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "missing dataclass field {}",
                        name.bind(py)
                    )))
                }
            };
            // SAFETY: all three are live; `PyObject_GenericSetAttr` is `object.__setattr__`,
            // which a dataclass's `__init__` uses for frozen classes and which plain ones reach.
            let ok = unsafe {
                ffi::PyObject_GenericSetAttr(obj.as_ptr(), name.as_ptr(), value.as_ptr())
            };
            if ok != 0 {
                return Err(PyErr::fetch(py));
            }
        }
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
