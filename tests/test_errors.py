"""The exception tree: every class says its HTTP status, and the edge names an OpenAI error type for each."""

import inspect

import ember.errors
from ember.api.errors import _TYPES, error_response


def test_every_error_class_carries_a_status_the_edge_names():
    classes = [
        c for _, c in inspect.getmembers(ember.errors, inspect.isclass) if issubclass(c, ember.errors.EmberError)
    ]
    assert len(classes) == len(ember.errors.__all__)
    for cls in classes:
        assert cls.status in _TYPES, cls
    assert ember.errors.InputTooLongError.status == 400 and ember.errors.RequestTooLargeError.status == 413
    assert ember.errors.OverloadedError.status == 429 and ember.errors.EngineDeadError.status == 503
    assert error_response(413, "x").status_code == 413
