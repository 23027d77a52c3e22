"""The partition type UUIDs of the Discoverable Partitions Specification that carry
dm-verity: root and /usr, their verity (hash) partitions and their verity signature
partitions, for every architecture the specification names.

Source: the UAPI group's Discoverable Partitions Specification (specs/
discoverable_partitions_specification.md; systemd's SD_GPT_* constants), typed in here
per architecture. systemd-repart names a partition "<designator>-<arch>[-verity[-sig]]"
(root-x86-64-verity-sig); partition_type() gives the same words.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

DATA, VERITY, SIGNATURE = "data", "verity", "verity-sig"  # what a partition holds
DESIGNATORS = ("root", "usr")

# architecture: (root, usr, root-verity, usr-verity, root-verity-sig, usr-verity-sig)
_ARCHITECTURES = {
    "alpha": ("6523f8ae-3eb1-4e2a-a05a-18b695ae656f", "e18cf08c-33ec-4c0d-8246-c6c6fb3da024",
              "fc56d9e9-e6e5-4c06-be32-e74407ce09a5", "8cce0d25-c0d0-4a44-bd87-46331bf1df67",
              "d46495b7-a053-414f-80f7-700c99921ef8", "5c6e1c76-076a-457a-a0fe-f3b4cd21ce6e"),
    "arc": ("d27f46ed-2919-4cb8-bd25-9531f3c16534", "7978a683-6316-4922-bbee-38bff5a2fecc",
            "24b2d975-0f97-4521-afa1-cd531e421b8d", "fca0598c-d880-4591-8c16-4eda05c7347c",
            "143a70ba-cbd3-4f06-919f-6c05683a78bc", "94f9a9a1-9971-427a-a400-50cb297f0f35"),
    "arm": ("69dad710-2ce4-4e3c-b16c-21a1d49abed3", "7d0359a3-02b3-4f0a-865c-654403e70625",
            "7386cdf2-203c-47a9-a498-f2ecce45a2d6", "c215d751-7bcd-4649-be90-6627490a4c05",
            "42b0455f-eb11-491d-98d3-56145ba9d037", "d7ff812f-37d1-4902-a810-d76ba57b975a"),
    "arm64": ("b921b045-1df0-41c3-af44-4c6f280d3fae", "b0e01050-ee5f-4390-949a-9101b17104e9",
              "df3300ce-d69f-4c92-978c-9bfb0f38d820", "6e11a4e7-fbca-4ded-b9e9-e1a512bb664e",
              "6db69de6-29f4-4758-a7a5-962190f00ce3", "c23ce4ff-44bd-4b00-b2d4-b41b3419e02a"),
    "ia64": ("993d8d3d-f80e-4225-855a-9daf8ed7ea97", "4301d2a6-4e3b-4b2a-bb94-9e0b2c4225ea",
             "86ed10d5-b607-45bb-8957-d350f23d0571", "6a491e03-3be7-4545-8e38-83320e0ea880",
             "e98b36ee-32ba-4882-9b12-0ce14655f46a", "8de58bc2-2a43-460d-b14e-a76e4a17b47f"),
    "loongarch64": ("77055800-792c-4f94-b39a-98c91b762bb6",
                    "e611c702-575c-4cbe-9a46-434fa0bf7e3f",
                    "f3393b22-e9af-4613-a948-9d3bfbd0c535",
                    "f46b2c26-59ae-48f0-9106-c50ed47f673d",
                    "5afb67eb-ecc8-4f85-ae8e-ac1e7c50e7d0",
                    "b024f315-d330-444c-8461-44bbde524e99"),
    "m68k": ("0cf191c8-3b54-433a-b715-68c6fa4086de", "a639b810-a02d-44bc-b579-d23e7bffdede",
             "843e63a4-c1ff-476e-a8a4-1b72e399475f", "267da076-7f71-445b-961f-f97b817dfd11",
             "d6e4b0ae-10f8-46d9-9f36-d8fd1a14b51f", "3b935677-dd33-4d7d-8b30-e602e316499e"),
    "mips": ("e9434544-6e2c-47cc-bae2-12d6deafb44c", "773b2abc-2a99-4398-8bf5-03baac40d02b",
             "7a430799-f711-4c7e-8e5b-1d685bd48607", "6e5a1bc8-d223-49b7-bca8-37a5fcceb996",
             "bba210a2-9c5d-45ee-9e87-ff2ccbd002d0", "97ae158d-f216-497b-8057-f7f905770f54"),
    "mips64": ("d113af76-80ef-41b4-bdb6-0cff4d3d4a25", "57e13958-7331-4365-8e6e-35eeee17c61b",
               "579536f8-6a33-4055-a95a-df2d5e2c42a8", "81cf9d90-7458-4df4-8dcf-c8a3a404f09b",
               "43ce94d4-0f3d-4999-8250-b9deafd98e6e", "05816ce2-dd40-4ac6-a61d-37d32dc1ba7d"),
    "mips-le": ("37c58c8a-d913-4156-a25f-48b1b64e07f0", "0f4868e9-9952-4706-979f-3ed3a473e947",
                "d7d150d2-2a04-4a33-8f12-16651205ff7b", "46b98d8d-b55c-4e8f-aab3-37fca7f80752",
                "c919cc1f-4456-4eff-918c-f75e94525ca5", "3e23ca0b-a4bc-4b4e-8087-5ab6a26aa8a9"),
    "mips64-le": ("700bda43-7a34-4507-b179-eeb93d7a7ca3",
                  "c97c1f32-ba06-40b4-9f22-236061b08aa8",
                  "16b417f8-3e06-4f57-8dd2-9b5232f41aa6",
                  "3c3d61fe-b5f3-414d-bb71-8739a694a4ef",
                  "904e58ef-5c65-4a31-9c57-6af5fc7c5de7",
                  "f2c2c7ee-adcc-4351-b5c6-ee9816b66e16"),
    "parisc": ("1aacdb3b-5444-4138-bd9e-e5c2239b2346", "dc4a4480-6917-4262-a4ec-db9384949f25",
               "d212a430-fbc5-49f9-a983-a7feef2b8d0e", "5843d618-ec37-48d7-9f12-cea8e08768b2",
               "15de6170-65d3-431c-916e-b0dcd8393f25", "450dd7d1-3224-45ec-9cf2-a43a346d71ee"),
    "ppc": ("1de3f1ef-fa98-47b5-8dcd-4a860a654d78", "7d14fec5-cc71-415d-9d6c-06bf0b3c3eaf",
            "98cfe649-1588-46dc-b2f0-add147424925", "df765d00-270e-49e5-bc75-f47bb2118b09",
            "1b31b5aa-add9-463a-b2ed-bd467fc857e7", "7007891d-d371-4a80-86a4-5cb875b9302e"),
    "ppc64": ("912ade1d-a839-4913-8964-a10eee08fbd2", "2c9739e2-f068-46b3-9fd0-01c5a9afbcca",
              "9225a9a3-3c19-4d89-b4f6-eeff88f17631", "bdb528a5-a259-475f-a87d-da53fa736a07",
              "f5e2c20c-45b2-4ffa-bce9-2a60737e1aaf", "0b888863-d7f8-4d9e-9766-239fce4d58af"),
    "ppc64-le": ("c31c45e6-3f39-412e-80fb-4809c4980599", "15bb03af-77e7-4d4a-b12b-c0d084f7491c",
                 "906bd944-4589-4aae-a4e4-dd983917446a", "ee2b9983-21e8-4153-86d9-b6901a54d1ce",
                 "d4a236e7-e873-4c07-bf1d-bf6cf7f1c3c6", "c8bfbd1e-268e-4521-8bba-bf314c399557"),
    "riscv32": ("60d5a7fe-8e7d-435c-b714-3dd8162144e1", "b933fb22-5c3f-4f91-af90-e2bb0fa50702",
                "ae0253be-1167-4007-ac68-43926c14c5de", "cb1ee4e3-8cd0-4136-a0a4-aa61a32e8730",
                "3a112a75-8729-4380-b4cf-764d79934448", "c3836a13-3137-45ba-b583-b16c50fe5eb4"),
    "riscv64": ("72ec70a6-cf74-40e6-bd49-4bda08e8f224", "beaec34b-8442-439b-a40b-984381ed097d",
                "b6ed5582-440b-4209-b8da-5ff7c419ea3d", "8f1056be-9b05-47c4-81d6-be53128e5b54",
                "efe0f087-ea8d-4469-821a-4c2a96a8386a", "d2f9000a-7a18-453f-b5cd-4d32f77a7b32"),
    "s390": ("08a7acea-624c-4a20-91e8-6e0fa67d23f9", "cd0f869b-d0fb-4ca0-b141-9ea87cc78d66",
             "7ac63b47-b25c-463b-8df8-b4a94e6c90e1", "b663c618-e7bc-4d6d-90aa-11b756bb1797",
             "3482388e-4254-435a-a241-766a065f9960", "17440e4f-a8d0-467f-a46e-3912ae6ef2c5"),
    "s390x": ("5eead9a9-fe09-4a1e-a1d7-520d00531306", "8a4f5770-50aa-4ed3-874a-99b710db6fea",
              "b325bfbe-c7be-4ab8-8357-139e652d2f6b", "31741cc4-1a2a-4111-a581-e00b447d2d06",
              "c80187a5-73a3-491a-901a-017c3fa953e9", "3f324816-667b-46ae-86ee-9b0c0c6c11b4"),
    "sparc64": ("f7b4d167-1e51-42a9-8151-ec96c2e99478", "db8ce399-787c-460a-80e3-69104c1ce375",
                "4a42d3da-9a55-4973-beff-173496dee76f", "c94cddd2-694d-4ce1-bf7b-8b6f29bafeb1",
                "795cf80b-dcbf-4952-9c7b-4fd4729dfd97", "0bebc110-9e89-4e17-9e52-6f3973889b2b"),
    "sh4": ("7b8f86b1-397a-4e1c-9eb0-850983baedc4", "0b6d8f08-1548-4183-a6fa-22fe95bc5422",
            "4a6c2f25-be67-45c5-95ac-255424f94f89", "7dd626a2-f8a9-4e38-b8aa-8cedfef0f0ee",
            "c6284716-c0b3-4c93-b349-a386d6bdee62", "71bbee31-fc3c-4ba4-8050-0b75ed32b466"),
    "tilegx": ("c50cdd70-3862-4cc3-90e1-809a8c93ee2c", "55497029-c7c1-44cc-aa39-815ed1558630",
               "966061ec-28e4-4b2e-b4a5-1f0a825a1d84", "2fb4bf56-07fa-42da-8132-6b139f2026ae",
               "b3671439-97b0-4a53-90f7-2d5a8f3ad47b", "4ede75e2-6ccc-4cc8-b9c7-70334b087510"),
    "x86": ("44479540-f297-41b2-9af7-d131d5f0458a", "75250d76-8cc6-458e-bd66-bd47cc81a812",
            "d13c5d3b-b5d1-422a-b29f-9454fdc89d76", "8f461b0d-14ee-4e81-9aa9-049b6fb97abd",
            "5996fc05-109c-48de-808b-23fa0830b676", "974a71c0-de41-43c3-be5d-5c5ccd1ad2c0"),
    "x86-64": ("4f68bce3-e8cd-4db1-96e7-fbcaf984b709", "8484680c-9521-48c6-9c11-b0720656f69e",
               "2c7357ed-ebd2-46d9-aec1-23d437ec2bf5", "77ff5f63-e7b6-4633-acf4-1565b864c0e6",
               "41092b05-9fc8-4523-994f-2def0408b176", "e7bb33fb-06cf-4e81-8273-e543b413e2e2"),
}
_COLUMNS = (("root", DATA), ("usr", DATA), ("root", VERITY), ("usr", VERITY),
            ("root", SIGNATURE), ("usr", SIGNATURE))


@dataclass(frozen=True)
class PartitionType:
    """What a Discoverable Partitions type UUID means."""

    designator: str  # "root" or "usr"
    role: str  # DATA, VERITY or SIGNATURE
    architecture: str  # as systemd names it: "x86-64", "arm64", ...

    @property
    def name(self) -> str:
        """systemd-repart's name: root-x86-64, root-x86-64-verity, usr-arm64-verity-sig."""
        suffix = "" if self.role == DATA else f"-{self.role}"
        return f"{self.designator}-{self.architecture}{suffix}"


TYPES: dict[uuid.UUID, PartitionType] = {
    uuid.UUID(text): PartitionType(designator, role, arch)
    for arch, uuids in _ARCHITECTURES.items()
    for text, (designator, role) in zip(uuids, _COLUMNS, strict=True)
}
if len(TYPES) != 6 * len(_ARCHITECTURES):  # a UUID typed twice would shadow another
    raise ImportError("Discoverable Partitions table: duplicate type UUID")


def partition_type(type_uuid: uuid.UUID) -> PartitionType | None:
    """The verity-related meaning of a partition type UUID, None for any other type."""
    return TYPES.get(type_uuid)
