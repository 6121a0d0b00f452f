"""The node_image role's estimate of the disk an image takes on a node that already holds some of it.

Used by roles/node_image (needs.yml); tests/unit/test_image_needs.py covers each case.
  image_bytes_needed: the bytes of the image's layers the node lacks. Docker keeps layers by chain
                      (a layer with every one below it), so what a node has of an image is a prefix
                      of its layers: the longest any image on the node shares. `docker history`
                      gives a size per history entry, newest first, without saying which entries
                      are layers; zero-size entries add nothing, and at most `zero` (layers minus
                      non-zero entries) of the shared layers are empty, so the newest non-zero
                      entries past the shared ones bound what has to come, from above.
"""


def _layers(line) -> list[str]:
    return [part for part in str(line).replace(",", " ").split() if part]


def image_bytes_needed(layers, history_sizes, node_images) -> int:
    """`layers`: the image's layer ids, oldest first; `history_sizes`: `docker history`'s sizes in
    bytes, newest first; `node_images`: a line of layer ids per image on the node."""
    wanted = _layers(" ".join(layers) if isinstance(layers, list) else layers)
    sizes = [int(s) for s in reversed(list(history_sizes)) if str(s).strip() and int(s) > 0]  # oldest first
    shared = 0
    for line in node_images:
        have = _layers(line)
        k = 0
        while k < min(len(have), len(wanted)) and have[k] == wanted[k]:
            k += 1
        shared = max(shared, k)
    if shared >= len(wanted) > 0:
        return 0
    zero = len(wanted) - len(sizes)
    if zero < 0:  # more sized entries than layers: not an image's history; count it whole
        return sum(sizes)
    past = len(sizes) - max(shared - zero, 0)  # the non-zero layers that may be missing
    return sum(sizes[len(sizes) - past:])


class FilterModule:
    def filters(self):
        return {"dlc_image_bytes_needed": image_bytes_needed}
