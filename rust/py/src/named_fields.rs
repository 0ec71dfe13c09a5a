//! The field names of a class whose instances the bindings build from `(field index, value)`
//! pairs (`struct_slots`, `dataclass_build`): a field's index by name, and the class's own
//! constructor called with such pairs as keywords (the path every shortcut falls back to).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

/// A class's field names, in its field order.
pub struct NamedFields {
    names: Vec<Py<PyString>>,
}

impl NamedFields {
    pub fn new(names: Vec<Py<PyString>>) -> Self {
        Self { names }
    }

    pub fn names(&self) -> &[Py<PyString>] {
        &self.names
    }

    /// The index of the field `name`.
    pub fn index(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.names
            .iter()
            .position(|n| n.bind(py) == name)
            .ok_or_else(|| {
                pyo3::exceptions::PyAttributeError::new_err(format!("no field {name:?}"))
            })
    }

    /// `cls(**{name of field i: value})` for the `given` `(i, value)` pairs.
    pub fn call<'py>(
        &self,
        cls: &Bound<'py, PyAny>,
        given: &[(usize, &Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = cls.py();
        let kwargs = PyDict::new(py);
        for (i, v) in given {
            kwargs.set_item(self.names[*i].bind(py), v)?;
        }
        cls.call((), Some(&kwargs))
    }
}
