class PipelineError(Exception):
    """A problem the user can fix (bad input, missing file or model, wrong run folder).

    The CLI prints its message as one line and exits non-zero, without a traceback.
    """
