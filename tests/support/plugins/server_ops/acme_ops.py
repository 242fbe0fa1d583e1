"""A private server operation from outside hurraykv, served by ``hurraykv serve`` through
the entry point group ``hurraykv.server_operations`` (this directory's dist-info names the
function): ``acme.shout`` answers the text it is sent (``u32 n + utf8``) in capitals."""

from hurraykv.net.messages import payload_reader


def shout(session, payload: bytes) -> bytes:
    r = payload_reader(payload, "acme.shout")
    text = r.text("text")
    r.end()
    return text.upper().encode()
