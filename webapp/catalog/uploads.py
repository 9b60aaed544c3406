"""An upload handler that enforces MAX_UPLOAD_BYTES while the body arrives, not after it has landed.

Django's temporary-file handler writes the upload to disk chunk by chunk; this one counts those
chunks and stops the upload (deleting its temporary file) the moment the limit is passed. The ASGI
body limit (`webapp.core.bodylimit`) refuses an oversized request even earlier, on its headers or
while daphne receives it; this is the second line for whatever reaches Django.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.files.uploadhandler import StopUpload, TemporaryFileUploadHandler


class LimitedUploadHandler(TemporaryFileUploadHandler):
    """Temporary-file uploads that stop, and remove their file, past MAX_UPLOAD_BYTES."""

    too_large = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = int(settings.MAX_UPLOAD_BYTES)
        self.seen = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        self.seen += len(raw_data)
        if self.seen > self.limit:
            self.too_large = True
            self.file.close()  # a NamedTemporaryFile: closing deletes it
            raise StopUpload(connection_reset=True)
        return super().receive_data_chunk(raw_data, start)
