// Attaching images to a message (docs/behaviour.md §16): pick, paste or drop.
//
// Everything goes into the composer's one file input (#id_images, present only when the
// session's model takes images), so a picked, pasted or dropped image is sent the same
// way, with the form. The list under it names what will be sent; a file over the size or
// count limit is said at once here, and refused by the server in the same words anyway.
(function () {
  "use strict";

  function input() { return document.getElementById("id_images"); }

  function megabytes(size) {
    if (size >= 1000000) return (Math.round(size / 100000) / 10) + " MB";
    return Math.max(1, Math.round(size / 1000)) + " KB";
  }

  function showError(text) {
    const slot = document.getElementById("composer-error");
    if (!slot) return;
    slot.textContent = text;  // text, never markup
    slot.hidden = !text;
  }

  // Name the attached files and check the limits; the text may be left empty once an
  // image is attached.
  function refresh() {
    const field = input();
    const list = document.getElementById("attached");
    const attach = document.getElementById("attach");
    const box = document.getElementById("id_text");
    if (!field || !list || !attach) return;
    const maxBytes = parseInt(attach.dataset.maxBytes || "0", 10);
    const maxCount = parseInt(attach.dataset.maxCount || "0", 10);
    const files = Array.from(field.files);
    list.replaceChildren();
    let problem = "";
    files.forEach(function (file) {
      const item = document.createElement("li");
      item.textContent = file.name + " (" + megabytes(file.size) + ")";
      list.appendChild(item);
      if (!problem && maxBytes && file.size > maxBytes) {
        problem = file.name + " is " + megabytes(file.size) + "; an image can be at most " + megabytes(maxBytes) + ".";
      }
    });
    if (!problem && maxCount && files.length > maxCount) {
      problem = "A message can carry at most " + maxCount + " images; this one has " + files.length + ".";
    }
    showError(problem);
    if (box) box.required = files.length === 0;
  }

  // Add files to the input, after the ones already there.
  function add(files) {
    const field = input();
    const images = Array.from(files || []).filter(function (f) { return f.type.indexOf("image/") === 0; });
    if (!field || images.length === 0) return false;
    const all = new DataTransfer();
    Array.from(field.files).forEach(function (f) { all.items.add(f); });
    images.forEach(function (f) { all.items.add(f); });
    field.files = all.files;
    refresh();
    return true;
  }

  function inComposer(node) {
    return node && node.closest && node.closest("#composer");
  }

  document.addEventListener("change", function (e) {
    if (e.target && e.target.id === "id_images") refresh();
  });
  document.addEventListener("paste", function (e) {
    if (!inComposer(e.target) || !e.clipboardData) return;
    if (add(e.clipboardData.files)) e.preventDefault();  // an image, not its file name as text
  });
  document.addEventListener("dragover", function (e) {
    if (inComposer(e.target) && input()) e.preventDefault();  // allow the drop
  });
  document.addEventListener("drop", function (e) {
    if (!inComposer(e.target) || !e.dataTransfer) return;
    if (add(e.dataTransfer.files)) e.preventDefault();
  });
})();
