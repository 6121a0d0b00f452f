"""Package repositories' signing keys, checked against their pinned fingerprints before apt trusts them.

A key fetched from a repository's URL (Grafana's, NVIDIA's container toolkit, the CUDA repository) is
kept in /etc/apt/keyrings only when every primary key in the file has a pinned fingerprint: a proxy
or a mirror in between cannot slip in a key of its own, and a rotated key is for a person to check.
Used by roles/grafana, roles/nvidia and roles/metrics; tests/unit/test_ansible.py compares the
fingerprints with gpg's own for real keyrings.
  openpgp_fingerprints: the primary keys' fingerprints in an ASCII-armored (or binary) key file.
  signing_key_problem:  one line naming the node, the URL, what was found, the pin and the fix; ""
                        when the file's keys are all pinned.
"""

from __future__ import annotations

import base64
import hashlib
import re

PUBLIC_KEY = 6  # the packet tag of a primary public key (subkeys are 14: not fingerprinted here)


def _dearmor(text: str | bytes) -> bytes:
    if isinstance(text, bytes) and b"-----BEGIN PGP" not in text:
        return text  # a binary (dearmored) key file
    text = text.decode("ascii", "replace") if isinstance(text, bytes) else text
    blocks = re.findall(r"-----BEGIN PGP PUBLIC KEY BLOCK-----\r?\n(.*?)-----END PGP PUBLIC KEY BLOCK-----",
                        text, re.S)
    if not blocks:
        raise ValueError("no PGP PUBLIC KEY BLOCK in it")
    data = b""
    for block in blocks:
        lines = [x.strip() for x in block.splitlines()]
        if "" in lines and all(": " in x for x in lines[:lines.index("")]):
            lines = lines[lines.index("") + 1:]  # the armor's headers (Comment: ..., Version: ...)
        body = "".join(x for x in lines if x and not x.startswith("="))  # "=XXXX" is the CRC line
        data += base64.b64decode(body, validate=True)
    return data


def _packets(data: bytes):
    """(tag, body) of each OpenPGP packet (RFC 9580, section 4.2: old and new formats)."""
    i = 0
    while i < len(data):
        first = data[i]
        if not first & 0x80:
            raise ValueError(f"byte {i} does not start a packet")
        if first & 0x40:  # new format
            tag, i = first & 0x3F, i + 1
            o = data[i]
            if o < 192:
                length, i = o, i + 1
            elif o < 224:
                length, i = ((o - 192) << 8) + data[i + 1] + 192, i + 2
            elif o == 255:
                length, i = int.from_bytes(data[i + 1:i + 5], "big"), i + 5
            else:
                raise ValueError("a partial-length packet in a key file")
        else:  # old format
            tag, kind, i = (first >> 2) & 0x0F, first & 0x03, i + 1
            if kind == 3:
                length = len(data) - i
            else:
                size = (1, 2, 4)[kind]
                length, i = int.from_bytes(data[i:i + size], "big"), i + size
        if i + length > len(data):
            raise ValueError("a packet runs past the end of the file")
        yield tag, data[i:i + length]
        i += length


def openpgp_fingerprints(text: str | bytes) -> list[str]:
    """The fingerprint (upper-case hex, as gpg prints it) of every primary key in the file."""
    found = []
    for tag, body in _packets(_dearmor(text)):
        if tag != PUBLIC_KEY or not body:
            continue
        version = body[0]
        if version == 4:
            found.append(hashlib.sha1(b"\x99" + len(body).to_bytes(2, "big") + body).hexdigest().upper())
        elif version in (5, 6):
            prefix = b"\x9a" if version == 5 else b"\x9b"
            found.append(hashlib.sha256(prefix + len(body).to_bytes(4, "big") + body).hexdigest().upper())
        else:
            raise ValueError(f"a version {version} key, which this check does not read")
    return found


def _normal(fingerprint: str) -> str:
    return re.sub(r"\s+", "", str(fingerprint)).upper()


def signing_key_problem(text: str, url: str, pinned: list, host: str, variable: str) -> str:
    """"" when every primary key in `text` has a fingerprint in `pinned`; else one line."""
    pins = [_normal(p) for p in (pinned or [])]
    if not pins:
        return (f"{host}: {variable} is empty: pin the fingerprint of the key at {url} (gpg --show-keys "
                f"on a copy you trust), then run again (the key was not kept: apt trusts nothing from it)")
    try:
        found = openpgp_fingerprints(text or "")
    except (ValueError, IndexError) as e:
        return (f"{host}: {url} did not send a readable OpenPGP key ({e}): a proxy or mirror in between? "
                f"Nothing was kept: apt trusts nothing from it")
    strangers = [f for f in found if f not in pins]
    if found and not strangers:
        return ""
    return (f"{host}: the signing key from {url} has fingerprint {', '.join(strangers or ['none'])}, not one "
            f"pinned in {variable} ({', '.join(pins)}): something in between sent its own key, or the "
            f"repository rotated its key; check the new one where the vendor publishes it and set "
            f"{variable}, then run again (the key was not kept: apt trusts nothing from it)")


class FilterModule:
    def filters(self):
        return {"openpgp_fingerprints": openpgp_fingerprints, "signing_key_problem": signing_key_problem}
