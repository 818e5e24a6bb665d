"""Coroutine layouts as data: pydantic models, validation, a generic runner, model-designed layouts."""
