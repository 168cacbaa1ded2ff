"""A test helper: a case's result, or its RuntimeError as comparable text (CPU and device cases compared whole)."""


def outcome(case, width: int = 70):
    try:
        return case()
    except RuntimeError as e:
        return f"RuntimeError: {str(e)[:width]}"
